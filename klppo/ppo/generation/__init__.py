"""Generation: the seam the rollout calls (`engine.py`) and its two engines, transformers' `generate` (`hf.py`, with
`static_cache.py` and `sampling.py`) and vLLM colocated in the training process (`vllm.py`); `correction.py`
corrects an inexact engine's drift by truncated importance sampling."""

from __future__ import annotations

from .engine import GenerationEngine, Sampled


def make_engine(
    args, accelerator, tokenizer, policy, engine: str | None, checkpointing_kwargs=None, prompt_sets=()
) -> GenerationEngine:
    """The run's engine: vLLM with `use_vllm`, else `generate`."""
    if getattr(args, "use_vllm", False):
        from .vllm import VLLMEngine

        return VLLMEngine(args, accelerator, tokenizer, policy, engine, prompt_sets)
    from .hf import GenerateEngine

    return GenerateEngine(args, accelerator, tokenizer, policy, engine, checkpointing_kwargs, prompt_sets)


__all__ = ["GenerationEngine", "Sampled", "make_engine"]
