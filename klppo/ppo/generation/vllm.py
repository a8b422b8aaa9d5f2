"""The vLLM engine: one vLLM engine colocated in each training process (TRL's colocate mode), behind the seam.

Started as TRL 1.16's `trl.generation.vllm_generation.VLLMGeneration` starts it in colocate mode (the rank's own
environment variables, `distributed_executor_backend="external_launcher"`, a seed per rank, processed log-probs so
that temperature scaling and masking are in them), with what klppo needs beside it:

- the engine is built from the policy's config and tokenizer with dummy weights (`load_format="dummy"`), then
  synced: whatever the policy was loaded from (a hub name, a GGUF, a LoRA adapter), the engine decodes the trainer's
  weights, never a checkpoint on disk;
- the sync works on a CPU as on a GPU: `reload_weights`' steps (vLLM repacks each linear weight for its kernels
  after loading; TRL's `model.load_weights` leaves the packed copies stale on a CPU), the tied LM head repacked from
  the new embedding, every weight vLLM holds checked as loaded (a sync that misses one raises), the prefix cache
  reset after;
- the weights are handed over one decoder layer at a time (the model's `_no_split_modules`; without them, all at
  once), a LoRA adapter merged into copies of that layer's base weights; under DeepSpeed ZeRO-3 and FSDP2 each
  layer is gathered while it is handed over, its adapter merged while it is whole, and a copy of its weights
  handed to the engine;
- klppo's sampling semantics: plain temperature sampling (no top-k / top-p, the model's generation config ignored),
  the run's stop token, suppressed ids masked (`allowed_token_ids`, whose masking the processed log-probs include),
  at most `response_length` tokens, one seed per sequence drawn from torch's generator (seeded runs repeat; each
  rank's seeds its own);
- on a CPU the KV cache is sized from the run's batch and lengths (left alone, vLLM asks for 92% of the host's
  memory and refuses to start).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections import Counter
from contextlib import ExitStack, contextmanager

import torch

from ..distributed import is_fsdp2, root_unsharded, unwrap
from ..prompts import longest_prompt
from ..results import PromptBatch
from .correction import _global
from .engine import GenerationEngine, Sampled
from .sampling import Generation, sampling_setup
from .static_cache import mergeable_lora_layers, merged_lora

logger = logging.getLogger(__name__)

KV_CACHE_FLOOR_MB = 64
CPU_BLOCK_SIZE = 128  # vLLM's CPU default, set explicitly so that the KV cache is sized in the blocks it allocates


def _is_peft(model) -> bool:
    return hasattr(model, "get_base_model") and hasattr(model, "peft_config")


def _checkpoint_names(named) -> list[tuple[str, torch.Tensor]]:
    """`(name, tensor)` of a model's (or a layer's) `named_parameters()` under their checkpoint names: a PEFT model's
    LoRA factors and saved originals left out, its wrapped base layers and saved modules under their own names."""
    out = []
    for name, param in named:
        if "lora_" in name or "original_module" in name:
            continue
        out.append((name.replace(".base_layer.", ".").replace("modules_to_save.default.", ""), param.data))
    return out


def _unmergeable() -> ValueError:
    return ValueError(
        "use_vllm: this LoRA adapter cannot be merged into copies of its base weights (a quantized base, a LoRA "
        "variant, or a target shared with another weight such as tied embeddings), so the engine would decode the "
        "base model without it. Target plain linear layers only, or decode with generate."
    )


def _refuse_unmergeable(module) -> None:
    """Raise when `module` (a PEFT model, or one layer of it) holds LoRA factors that cannot be merged into copies
    of their base weights: the engine would decode the base model without them."""
    if mergeable_lora_layers(module) is None and any("lora_" in name for name, _ in module.named_parameters()):
        raise _unmergeable()


def _refuse_other_adapters(model) -> None:
    """Raise when a PEFT `model` holds an adapter other than LoRA: prompt and prefix tuning live outside the base
    model's weights (the engine would decode the base model without them), and IA3, LoHa or LoKr have no merge
    into copies of the base weights here."""
    kinds = {str(getattr(c.peft_type, "value", c.peft_type)) for c in model.peft_config.values()}
    if kinds - {"LORA"}:
        raise ValueError(
            f"use_vllm with a {', '.join(sorted(kinds - {'LORA'}))} adapter: the engine decodes the base weights with "
            "LoRA adapters merged into copies of them, and this adapter has no such merge, so the engine would decode "
            "another model than the trainer's. Use a LoRA adapter (peft_config=LoraConfig(...)), or decode with "
            "generate (use_vllm: false)."
        )


def _lora_layers(model) -> list[tuple[str, torch.nn.Module]]:
    """`(name, layer)` of every LoRA layer in `model` (none without PEFT)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return []
    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]


@contextmanager
def _whole(module, params: list):
    """Inside the block, `params` (of `module`) are whole on this rank: DeepSpeed ZeRO-3 gathers them (read only),
    or FSDP2 unshards every unit in `module` (None: none). Every rank enters the same blocks in the same order (each
    gather is a collective)."""
    units = [] if module is None else [m for m in module.modules() if is_fsdp2(m)]
    if units:
        for unit in units:
            unit.unshard()
        try:
            yield
        finally:
            for unit in reversed(units):
                unit.reshard()
        return
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            yield
        return
    yield


def _whole_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a weight made whole, or of a weight that FSDP2 shards outside the units made whole (gathered)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.clone()


def _refuse_shared_lora_bases(model) -> None:
    """Raise when a LoRA layer of `model` adapts a weight that another parameter shares (tied embeddings with a LoRA
    on the LM head): merging it would change the other. Checked by parameter identity, which holds for ZeRO-3's
    partitions and FSDP2's DTensors, whose storage does not tell."""
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    for _, layer in _lora_layers(model):
        weight = getattr(layer.get_base_layer(), "weight", None)
        if weight is not None and uses[id(weight)] > 1:
            raise _unmergeable()


@contextmanager
def _random_state_kept():
    """Put back the process's random generators (Python's, NumPy's, torch's) after the block: a vLLM engine seeds
    them with its own seed as it starts. Left reseeded, the rank's seed would replace the run's, and the ranks would
    shuffle the prompts each their own way (accelerate's sampler takes torch's initial seed), no longer splitting
    one permutation between them."""
    import random

    import numpy as np

    cuda = torch.cuda.is_available()  # read now: the engine initialises CUDA and seeds it
    states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if cuda else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


def _reload(worker, weights, repack_tied_head: bool) -> list[str]:
    """Run in the engine's worker (`LLM.collective_rpc`): load `weights` (an iterable of checkpoint names and
    tensors, read once) in place, as vLLM's `reload_weights` does, repack a tied LM head on a CPU, and return the
    names of vLLM's parameters that no weight reached."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    runner = worker.model_runner
    model = runner.get_model()
    expected = {name for name, _ in model.named_parameters()}
    initialize_layerwise_reload(model)
    loaded = model.load_weights(iter(weights))
    finalize_layerwise_reload(model, runner.vllm_config.model_config)
    if repack_tied_head:  # the tied head's packed copy is of the old embedding (its own weight loads nothing)
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        dispatch_cpu_unquantized_gemm(model.lm_head, remove_weight=False)
    for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
        if hasattr(runner, reset):
            getattr(runner, reset)()
    return sorted(expected - set(loaded or ()))


def max_model_length(args, config, tokenizer, prompt_sets) -> int:
    """The engine's longest sequence: `vllm_max_model_length`, or the longest prompt of `prompt_sets` (the run's
    datasets; at most `max_prompt_length`, or without it what the model's positions leave) plus `response_length`.
    A `vllm_max_model_length` shorter than the datasets need is refused (the run would stop at that prompt)."""
    cap = args.max_prompt_length
    if cap is None:
        cap = int(getattr(config, "max_position_embeddings", 2048)) - int(args.response_length)
    datasets = any(dataset is not None for dataset in prompt_sets)
    width = longest_prompt(prompt_sets, tokenizer, cap) if datasets else cap
    need = int(width) + int(args.response_length)
    given = args.experimental.vllm_max_model_length
    if given is None:
        return need
    if datasets and int(given) < need:
        raise ValueError(
            f"experimental.vllm_max_model_length is {given}, and the run's longest prompt ({width} tokens) plus "
            f"response_length ({args.response_length}) needs {need}: the engine would refuse that prompt mid-run. "
            f"Set vllm_max_model_length to at least {need}, or leave it unset (the engine then takes exactly what "
            "the datasets need)."
        )
    return int(given)


class VLLMEngine(GenerationEngine):
    """A colocated vLLM engine (see the module's docstring).

    Args:
        args: the run's `KLPPOConfig`.
        accelerator: the trainer's accelerator (rank, device).
        tokenizer: the policy's tokenizer.
        policy: the policy (a PEFT model or not), before distributed wrapping.
        engine: `"deepspeed"`, `"fsdp"` or None; under the first two the sync gathers the weights one decoder layer
            at a time.
        prompt_sets: the datasets whose prompts the run decodes (the engine's longest sequence).
    """

    name = "vllm"
    exact = False
    reads_while_decoding = False
    holds_weights = True

    def __init__(self, args, accelerator, tokenizer, policy, engine: str | None, prompt_sets=()):
        from vllm import LLM

        self.sharding = engine  # DeepSpeed or FSDP2: the sync gathers the weights one decoder layer at a time
        if engine == "fsdp" and getattr(accelerator.state.fsdp_plugin, "fsdp_version", 2) != 2:
            raise ValueError(
                "use_vllm under FSDP version 1: klppo gathers the weights for the engine's sync from FSDP2's units "
                "only. Set fsdp_version: 2 in the accelerate config (configs/accelerate/fsdp.yaml), or decode with "
                "generate (use_vllm: false)."
            )

        self.args, self.accelerator, self.tokenizer = args, accelerator, tokenizer
        self.pad_token_id = tokenizer.pad_token_id
        self.stop_token_id, self.suppressed_ids, _ = sampling_setup(
            args, tokenizer, getattr(policy, "generation_config", None)
        )
        if _is_peft(policy):
            _refuse_other_adapters(policy)
        base = policy.get_base_model() if _is_peft(policy) else policy
        _refuse_shared_lora_bases(base)  # at the start, before any engine shards or re-ties the weights
        self.config = base.config
        # the decoder layers, by class: the units the sync gathers one at a time under a sharded engine
        self.layer_classes = frozenset(getattr(base, "_no_split_modules", None) or ())
        self.allowed_ids = None  # the suppressed ids are masked as vLLM does it: every other id allowed
        if self.suppressed_ids is not None and len(self.suppressed_ids):
            banned = set(self.suppressed_ids.tolist())
            vocab = int(self.config.get_text_config().vocab_size)
            self.allowed_ids = [i for i in range(vocab) if i not in banned]
        self.tied = bool(getattr(self.config, "tie_word_embeddings", False))
        self.max_model_len = max_model_length(args, self.config, tokenizer, prompt_sets)
        self.max_num_seqs = max(1, int(args.local_rollout_batch_size))
        dtype = next(p.dtype for p in base.parameters() if p.is_floating_point())
        if args.experimental.vllm_dtype != "auto":
            dtype = getattr(torch, args.experimental.vllm_dtype)
        self.on_cpu = accelerator.device.type == "cpu"
        # the engine's directory: the config and the tokenizer only; the weights come from the trainer (`sync_weights`)
        self._dir = tempfile.TemporaryDirectory(prefix="klppo-vllm-")
        self.config.save_pretrained(self._dir.name)
        tokenizer.save_pretrained(self._dir.name)
        kwargs = {}
        eager = args.experimental.vllm_enforce_eager
        if eager if eager is not None else self.on_cpu:  # a GPU: vLLM's default, compiled with CUDA graphs
            kwargs["enforce_eager"] = True
        if self.on_cpu:
            kwargs["kv_cache_memory_bytes"] = int(self.kv_cache_mb() * 2**20)
            kwargs["block_size"] = CPU_BLOCK_SIZE
        else:
            kwargs["gpu_memory_utilization"] = args.experimental.vllm_gpu_memory_utilization
            kwargs["enable_sleep_mode"] = args.experimental.vllm_enable_sleep_mode
        # vLLM needs the rank's environment in the process that runs it (TRL's colocate mode sets the same); what
        # was set here is taken out again at shutdown
        names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        self._environ_added = [name for name in names if name not in os.environ]
        os.environ.setdefault("RANK", str(accelerator.process_index))
        os.environ.setdefault("LOCAL_RANK", str(accelerator.local_process_index))
        os.environ.setdefault("WORLD_SIZE", str(accelerator.num_processes))
        from trl.trainer.utils import ensure_master_addr_port

        ensure_master_addr_port()
        # the engine initialises torch.distributed when no launcher did (gloo, world size 1): it then owns it
        self._owns_process_group = not torch.distributed.is_initialized()
        start = time.perf_counter()
        self.llm, self._closed = None, False
        try:
            self._start(LLM, dtype, kwargs)
        except BaseException:  # what the engine set is taken out again
            self.shutdown()
            raise
        self.start_seconds = time.perf_counter() - start
        logger.info(
            "vLLM engine started in %.1f s (max_model_len %d, %d sequences%s).",
            self.start_seconds,
            self.max_model_len,
            self.max_num_seqs,
            f", KV cache {self.kv_cache_mb():.0f} MiB" if self.on_cpu else "",
        )
        self._synced_once = False
        self.sync_seconds: list[float] = []
        # sleep mode (a GPU only): asleep at level 2 (weights and KV cache freed) from the end of one generation to
        # the next sync, which loads every weight anyway
        self.sleeps = bool(kwargs.get("enable_sleep_mode"))
        self._weights_asleep = False
        if self.sleeps:
            self.llm.sleep(level=2)
            self._weights_asleep = True

    def _start(self, LLM, dtype, kwargs) -> None:
        """Start the engine (`self.llm`) from the config and tokenizer in the engine's directory, with dummy weights
        until the first sync."""
        with _random_state_kept():
            self.llm = LLM(
                model=self._dir.name,
                tokenizer=self._dir.name,
                load_format="dummy",
                dtype=dtype,
                tensor_parallel_size=1,
                max_model_len=self.max_model_len,
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=max(4096, self.max_model_len),
                enable_prefix_caching=True,
                distributed_executor_backend="external_launcher",
                seed=self.accelerator.process_index,
                logprobs_mode="processed_logprobs",
                generation_config="vllm",
                **kwargs,
            )

    def kv_cache_mb(self) -> float:
        """The KV cache on a CPU, MiB: `vllm_kv_cache_mb`, or every sequence of the local batch at the engine's
        longest length rounded up to whole blocks (K and V, every layer), with a floor. Sized in tokens instead,
        a cache of 128-token blocks holds fewer sequences than the batch, and the engine decodes it in waves."""
        if self.args.experimental.vllm_kv_cache_mb is not None:
            return float(self.args.experimental.vllm_kv_cache_mb)
        c = self.config
        heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        per_token = 2 * c.num_hidden_layers * heads * head_dim * 4  # float32 bytes, an upper bound for bf16
        blocks = -(-self.max_model_len // CPU_BLOCK_SIZE)
        # one block more than the sequences take: vLLM's block pool keeps its first block as a null block
        need = per_token * CPU_BLOCK_SIZE * (blocks * self.max_num_seqs + 1) / 2**20
        return max(float(KV_CACHE_FLOOR_MB), need)

    # ------------------------------------------------------------------ weights
    def _layers(self, base) -> tuple[list, tuple, list]:
        """`(layers, prefixes, outside)` of the base model, found once (the model's modules stay as they are): its
        decoder layers as `(name, module)` by class name through the MRO (FSDP2 subclasses each unit it wraps,
        `FSDPLlamaDecoderLayer`; a layer inside a layer is its own), their names' prefixes, and the LoRA layers
        outside them."""
        if getattr(self, "_layer_split", (None,))[0] is not base:
            layers, prefixes = [], ()
            for name, module in base.named_modules():
                if name.startswith(prefixes):
                    continue
                if any(cls.__name__ in self.layer_classes for cls in type(module).__mro__):
                    layers.append((name, module))
                    prefixes += (f"{name}.",)
            outside = [layer for name, layer in _lora_layers(base) if not name.startswith(prefixes)]
            self._layer_split = (base, layers, prefixes, outside)
        return self._layer_split[1:]

    def _layerwise_weights(self, policy, loaded: list):
        """The policy's weights under their checkpoint names, one decoder layer at a time (the model's
        `_no_split_modules`), then the rest of the model (embeddings, final norm, LM head): a LoRA adapter merged
        into copies of a layer's base weights while that layer is handed over, so that one layer's merged copies
        are alive at a time, not the whole model's. Under a sharded engine each layer is gathered (ZeRO-3) or
        unsharded (FSDP2; its root, whole for the whole sync) while it is handed over, and a copy of each weight
        yielded (vLLM keeps a layer's weights until the layer is complete; the gathered ones are freed when it is
        sharded again). Counts the weights in `loaded[0]`."""
        copy = _whole_copy if self.sharding is not None else (lambda tensor: tensor)
        base = policy.get_base_model() if _is_peft(policy) else policy
        layers, prefixes, outside = self._layers(base)
        for name, layer in layers:
            with _whole(layer, list(layer.parameters())):
                if self.sharding is not None:  # whole only now (unsharded: checked before the sync)
                    _refuse_unmergeable(layer)
                with merged_lora(layer):
                    for weight_name, tensor in _checkpoint_names(layer.named_parameters(prefix=name)):
                        loaded[0] += 1
                        yield weight_name, copy(tensor)
        rest = [(n, p) for n, p in base.named_parameters() if not n.startswith(prefixes)]
        with _whole(None, [p for _, p in rest]), ExitStack() as merged:
            for layer in outside:
                _refuse_unmergeable(layer)
                merged.enter_context(merged_lora(layer))  # into copies: `rest` reads them through `.data`
            for weight_name, tensor in _checkpoint_names(rest):
                loaded[0] += 1
                yield weight_name, copy(tensor)

    @torch.no_grad()
    def sync_weights(self, model_wrapped) -> dict[str, float]:
        """Load the policy's current weights into the engine (a LoRA adapter merged), then reset its prefix cache.
        Raises when no weight was loaded or some weight of the engine was not."""
        start = time.perf_counter()
        if self.sleeps:  # the weights' memory mapped again before they are loaded (TRL does the same)
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=["weights"])
        policy = unwrap(self.accelerator, model_wrapped).policy
        repack = self.on_cpu and self.tied
        if _is_peft(policy) and self.sharding is None:  # before any weight is loaded (sharded: per gathered layer)
            _refuse_unmergeable(policy)
        count = [0]
        with root_unsharded(model_wrapped):
            missing = self.llm.collective_rpc(_reload, args=(self._layerwise_weights(policy, count), repack))[0]
        loaded = count[0]
        if not loaded:
            raise RuntimeError(
                "use_vllm: the weight sync found no weight to load into the engine. Decode with generate "
                "(use_vllm: false) for this model."
            )
        if missing:
            raise RuntimeError(
                f"use_vllm: the weight sync left {len(missing)} of the engine's weights as they were ({', '.join(missing[:5])}"
                f"{', ...' if len(missing) > 5 else ''}): the engine would decode another model than the trainer's. "
                "Its parameter names do not match the policy's (an architecture vLLM maps differently): decode "
                "with generate (use_vllm: false) for this model."
            )
        if self.llm.reset_prefix_cache() is False:  # blocks still held: a prefix cached under the old weights
            raise RuntimeError(  # would be read again
                "use_vllm: the engine could not reset its prefix cache after the weight sync (some of its blocks are "
                "still held by an unfinished request), so the next rollout could reuse keys and values computed with "
                "the old weights. This is a bug: please report it with the run's log."
            )
        self._synced_once, self._weights_asleep = True, False
        seconds = time.perf_counter() - start
        self.sync_seconds.append(seconds)
        return {"time/weight_sync": seconds}

    # ------------------------------------------------------------------ sampling
    def sampling_params(self, seed: int):
        from vllm import SamplingParams

        kwargs = dict(
            n=1,
            temperature=float(self.args.temperature),
            top_p=1.0,
            top_k=0,
            min_p=0.0,
            repetition_penalty=1.0,
            max_tokens=int(self.args.response_length),
            min_tokens=0,
            logprobs=0,
            ignore_eos=True,
            detokenize=False,
            skip_special_tokens=False,
            seed=int(seed),
            # each request's own object, never changed after (the allowed ids' list, shared, is only read): vLLM's
            # deep copy of it would copy that list (the whole vocabulary) per request, which took longer than
            # decoding 12 tokens
            skip_clone=True,
        )
        if self.stop_token_id is not None:
            kwargs["stop_token_ids"] = [int(self.stop_token_id)]
        if self.allowed_ids is not None:
            kwargs["allowed_token_ids"] = self.allowed_ids
        return SamplingParams(**kwargs)

    def generate(self, batch: PromptBatch, plan) -> Sampled:
        """One batch of prompts through the engine: responses, their masks and the engine's processed log-probs."""
        if not self._synced_once:
            raise RuntimeError("use_vllm: the engine decodes before its first weight sync (its weights are dummies).")
        if self._weights_asleep:
            raise RuntimeError(
                "use_vllm: the engine decodes after sleeping without a weight sync (its weights are gone)."
            )
        rows = batch.input_ids.shape[0]
        prompts = [
            {"prompt_token_ids": ids[mask.bool()].tolist()}
            for ids, mask in zip(batch.input_ids.cpu(), batch.attention_mask.cpu())
        ]
        longest = max((len(p["prompt_token_ids"]) for p in prompts), default=0)
        # every rank refuses, or none: one rank alone would leave the others waiting in the next collective
        longest = int(_global(torch.tensor(longest), "max", self.accelerator))
        if longest + int(self.args.response_length) > self.max_model_len:
            # vLLM would cut the response short at max_model_len without a stop token, and the cut would be trained
            # on as if sampled
            raise ValueError(
                f"use_vllm: a prompt of {longest} tokens plus response_length {self.args.response_length} is longer "
                f"than the engine's max_model_len, {self.max_model_len} (the longest prompt of the run's datasets plus "
                "response_length, or experimental.vllm_max_model_length). Set experimental.vllm_max_model_length to "
                f"at least {longest + int(self.args.response_length)} (at most max_prompt_length + response_length is "
                "ever needed), or give prompts no longer than the datasets'."
            )
        if self.sleeps:
            self.llm.wake_up(tags=["kv_cache"])
        # from torch's stream (seeded runs repeat), made the rank's own: every rank draws alike when the ranks hold
        # as many prompts (training), and rank r's seeds are r more than a multiple of the number of ranks
        ranks = self.accelerator.num_processes
        drawn = torch.randint(0, (2**31 - 1) // ranks, (rows,))
        seeds = (drawn * ranks + self.accelerator.process_index).tolist()
        params = [self.sampling_params(seed) for seed in seeds]
        try:
            outputs = self.llm.generate(prompts, sampling_params=params, use_tqdm=False)
        finally:
            if self.sleeps:  # level 2: the weights and the KV cache freed until the next sync
                self.llm.sleep(level=2)
                self._weights_asleep = True
        width = max(1, max(len(out.outputs[0].token_ids) for out in outputs))
        tokens = torch.full((rows, width), self.pad_token_id, dtype=torch.long)
        logp = torch.zeros((rows, width), dtype=torch.float32)
        for i, out in enumerate(outputs):
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            tokens[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            logp[i, : len(ids)] = torch.tensor([step[t].logprob for step, t in zip(completion.logprobs, ids)])
        finite = bool(torch.isfinite(logp).all())
        device = batch.input_ids.device
        tokens, logp = tokens.to(device), logp.to(device)
        sequences = self.sequences(batch, tokens, self.pad_token_id, finite, sampling_logp=logp)
        return Sampled(sequences, Generation(sequences.responses, finite=finite))

    def shutdown(self) -> None:
        """Free the engine, its process groups, and torch.distributed when the engine started it (a later trainer
        in the same process then starts from a clean state: accelerate would otherwise take the engine's group for a
        distributed launch)."""
        import gc

        if getattr(self, "_closed", True):
            return
        self._closed = True
        self.llm = None
        gc.collect()
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        try:
            destroy_model_parallel()
            if self._owns_process_group:
                destroy_distributed_environment()
        finally:
            for name in self._environ_added:
                os.environ.pop(name, None)
            self._dir.cleanup()
