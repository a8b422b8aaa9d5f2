"""Prompt datasets (built-in, local files, conversational) and held-out text."""

from __future__ import annotations

import json

import pytest
from datasets import Dataset

from klppo.data import (
    HELDOUT_TEXT_ID,
    OFFLINE_PROMPTS_ID,
    load_heldout_texts,
    load_prompt_dataset,
    offline_prompts,
    pydoc_passages,
)

ROWS = [{"text": f"Prompt number {i} about the weather", "label": i} for i in range(6)]


def test_offline_prompts_are_many_unique_and_short():
    prompts = offline_prompts("all")
    assert len(prompts) >= 200
    assert len(set(prompts)) == len(prompts)
    assert all(0 < len(p) <= 80 and p == p.strip() for p in prompts)


def test_offline_split_is_fixed_and_disjoint():
    train, evaluation = offline_prompts("train"), offline_prompts("eval")
    assert len(train) >= 180 and len(evaluation) >= 20
    assert not set(train) & set(evaluation)
    assert sorted(train + evaluation) == sorted(offline_prompts("all"))
    assert evaluation == offline_prompts("all")[9::10]
    with pytest.raises(ValueError, match="train"):
        offline_prompts("dev")


def test_builtin_dataset_splits_and_sampling():
    train = load_prompt_dataset(OFFLINE_PROMPTS_ID)
    assert train.column_names == ["prompt"] and train["prompt"] == offline_prompts("train")
    assert load_prompt_dataset(OFFLINE_PROMPTS_ID, split="test")["prompt"] == offline_prompts("eval")
    a = load_prompt_dataset(OFFLINE_PROMPTS_ID, max_samples=16, seed=3)["prompt"]
    assert len(a) == 16 and a == load_prompt_dataset(OFFLINE_PROMPTS_ID, max_samples=16, seed=3)["prompt"]
    assert set(a) <= set(offline_prompts("train"))
    assert a != load_prompt_dataset(OFFLINE_PROMPTS_ID, max_samples=16, seed=4)["prompt"]


def test_conversational_format(tmp_path):
    ds = load_prompt_dataset(OFFLINE_PROMPTS_ID, split="eval", conversational=True)
    assert ds[0]["prompt"] == [{"role": "user", "content": offline_prompts("eval")[0]}]
    # prompts that are already conversational are kept as they are
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "Hi"}]}) + "\n")
    assert load_prompt_dataset(str(path), conversational=True)[0]["prompt"] == [{"role": "user", "content": "Hi"}]


def _write(tmp_path, suffix: str):
    path = tmp_path / f"prompts{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    elif suffix == ".csv":
        path.write_text("text,label\n" + "".join(f"{r['text']},{r['label']}\n" for r in ROWS))
    else:
        Dataset.from_list(ROWS).to_parquet(str(path))
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_local_files_with_renamed_column(tmp_path, suffix):
    ds = load_prompt_dataset(str(_write(tmp_path, suffix)), prompt_column="text", conversational=(suffix == ".csv"))
    assert set(ds.column_names) == {"prompt", "label"}  # other columns reach the reward functions
    expected = [r["text"] for r in ROWS]
    if suffix == ".csv":
        assert [p[0]["content"] for p in ds["prompt"]] == expected
    else:
        assert ds["prompt"] == expected


def test_errors_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="does not exist.*check the path"):
        load_prompt_dataset(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="no column 'prompt'.*prompt_column"):
        load_prompt_dataset(str(_write(tmp_path, ".jsonl")))
    with pytest.raises(ValueError, match=OFFLINE_PROMPTS_ID):
        load_prompt_dataset("klppo:other-prompts")


def test_heldout_pydoc_passages():
    passages = pydoc_passages()
    assert len(passages) > 100
    assert all(200 <= len(p) <= 1000 for p in passages)
    assert all("  " not in p and "\n" not in p and "*****" not in p for p in passages)

    texts = load_heldout_texts(HELDOUT_TEXT_ID, max_texts=16, seed=0)
    assert len(texts) == 16 and len(set(texts)) == 16 and set(texts) <= set(passages)
    assert texts == load_heldout_texts(max_texts=16, seed=0)
    assert texts != load_heldout_texts(max_texts=16, seed=1)
    assert len(load_heldout_texts(max_texts=None)) == len(passages)


def test_heldout_local_files(tmp_path):
    txt = tmp_path / "held.txt"
    txt.write_text("first text\n\n  second text  \nthird\n")
    assert load_heldout_texts(str(txt), max_texts=None) == ["first text", "second text", "third"]
    jsonl = tmp_path / "held.jsonl"
    jsonl.write_text('{"text": "a b c"}\n{"text": "d e"}\n')
    assert load_heldout_texts(str(jsonl)) == ["a b c", "d e"]
    with pytest.raises(ValueError, match="text_column"):
        load_heldout_texts(str(jsonl), text_column="body")
    with pytest.raises(ValueError, match="does not exist"):
        load_heldout_texts(str(tmp_path / "nope.txt"))
