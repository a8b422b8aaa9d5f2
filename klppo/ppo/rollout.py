"""Rollout helpers: prompt batches, generation, stop-token truncation, response masks, log-prob scoring."""

from __future__ import annotations

import copy
from collections import Counter
from contextlib import contextmanager, nullcontext

import torch
from torch import nn
from torch.utils.data import DataLoader
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList
from trl.trainer.utils import selective_log_softmax

from ..rewards.text import is_conversational
from .health import TrainingDiverged
from .steps import PromptBatch
from .value import last_hidden_states


def collate_prompts(features: list[dict], tokenizer, max_prompt_length: int | None) -> PromptBatch:
    """Tokenize dataset rows (a `prompt` column, plain or conversational) into a left-padded batch. A
    conversational prompt goes through the tokenizer's chat template with the generation prompt; rows of
    pre-tokenized `input_ids` (and no `prompt`) are used as they are, their decoded text standing for the prompt.
    Prompts longer than `max_prompt_length` keep their last tokens. Other columns travel in `extra`."""
    if "prompt" not in features[0]:  # pre-tokenized, as TRL's PPO scripts prepare their datasets
        ids = [list(f["input_ids"]) for f in features]
        features = [{k: v for k, v in f.items() if k not in ("input_ids", "attention_mask")} for f in features]
        prompts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    elif is_conversational(features[0]["prompt"]):
        prompts = [f["prompt"] for f in features]
        texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]
        ids = tokenizer(texts, add_special_tokens=False, padding=False)["input_ids"]
    else:
        prompts = [f["prompt"] for f in features]
        ids = tokenizer(prompts, padding=False)["input_ids"]
    if max_prompt_length:
        ids = [x[-max_prompt_length:] for x in ids]
    width = max(len(x) for x in ids)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
    attention_mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    extra = {k: [f[k] for f in features] for k in features[0] if k != "prompt"}
    return PromptBatch(prompts, input_ids, attention_mask, extra)


def endless_prompt_batches(dataset, batch_size: int, collate, accelerator, seed: int, skip: int = 0):
    """Endless rollout batches of prompts for this rank, reshuffled each pass (seeded); the first `skip`
    batches are skipped (a resumed run continues where the checkpoint stopped)."""
    loader = DataLoader(
        dataset, batch_size=batch_size, shuffle=True, drop_last=True, collate_fn=collate,
        generator=torch.Generator().manual_seed(seed),
    )  # fmt: skip
    loader = accelerator.prepare_data_loader(loader)
    if len(loader) == 0:
        raise ValueError(
            f"The prompt set ({len(dataset)} prompts) is smaller than one global rollout batch "
            f"({batch_size * accelerator.num_processes}). Lower "
            "per_device_train_batch_size / gradient_accumulation_steps / num_mini_batches or add prompts."
        )
    seen, epoch = 0, 0
    while True:
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        for batch in loader:
            seen += 1
            if seen > skip:
                yield batch
        epoch += 1


@contextmanager
def clear_sampling_errors():
    """Sampling from a policy whose logits are NaN or inf fails deep inside torch; say what it means."""
    try:
        yield
    except RuntimeError as err:
        text = str(err).lower()
        if "inf" in text or "nan" in text:
            raise TrainingDiverged(
                "The policy's logits are not finite, so no response can be sampled: its weights have diverged. "
                "Lower the learning rate or max_grad_norm, raise the KL coefficient, or use bf16/fp32 instead of "
                "fp16; resume from the last checkpoint (checkpoints written so far are intact)."
            ) from err
        raise


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids for left-padded sequences: `cumsum(mask) - 1`, clamped at 0 on padding. `[B, L]`."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def truncate_at_stop(
    responses: torch.Tensor, stop_token_id: int | None, pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut each response after its first stop token.

    Args:
        responses: `[B, R]` generated token ids.

    Returns:
        `(responses, mask)`: tokens after the first stop token replaced by `pad_token_id`; `mask [B, R]` is 1
        up to and including the stop token (every token when there is none, or when `stop_token_id` is None).
    """
    positions = torch.arange(responses.shape[1], device=responses.device).expand_as(responses)
    if stop_token_id is None:
        last = torch.full_like(responses[:, 0], responses.shape[1] - 1)
    else:
        is_stop = responses == stop_token_id
        first = torch.where(is_stop, positions, torch.full_like(positions, responses.shape[1]))
        last = first.min(dim=1).values.clamp(max=responses.shape[1] - 1)
    mask = positions <= last.unsqueeze(1)
    return torch.where(mask, responses, torch.full_like(responses, pad_token_id)), mask.long()


def ends_with_stop(responses: torch.Tensor, mask: torch.Tensor, stop_token_id: int | None) -> torch.Tensor:
    """`[B]` bool: whether the last valid token of each response is the stop token."""
    if stop_token_id is None:
        return torch.ones(responses.shape[0], dtype=torch.bool, device=responses.device)
    last = mask.sum(dim=1) - 1
    return responses.gather(1, last.unsqueeze(1)).squeeze(1) == stop_token_id


def suppressed_token_ids(stop_token_id: int | None, tokenizer, model_generation_config=None) -> list[int]:
    """Token ids that generation never samples: the end-of-sequence ids when responses have a fixed length
    (`stop_token_id` None), else none.

    Responses of fixed length must not end early, so the end-of-sequence tokens (the tokenizer's and the
    model's generation config's) are suppressed while sampling. The same ids are masked out of every
    log-softmax that is scored (`response_logits`), so the trained distribution is exactly the sampled one;
    scoring the raw logits instead would let the suppressed tokens' probability drift unseen, and the model
    would later emit them whenever they are allowed.
    """
    if stop_token_id is not None:
        return []
    ids = {tokenizer.eos_token_id}
    model_eos = getattr(model_generation_config, "eos_token_id", None)
    ids.update(model_eos if isinstance(model_eos, (list, tuple)) else [model_eos])
    return sorted(i for i in ids if i is not None)


def sampling_setup(args, tokenizer, policy_generation_config=None):
    """`(stop_token_id, suppressed_ids, generation_config)` of a run: the stop token (`stop_token_id`, or EOS
    with `stop_token="eos"`, or None for fixed-length responses), the token ids never sampled as a tensor (or
    None) and the sampling configuration."""
    stop_token_id = args.stop_token_id
    if stop_token_id is None and args.stop_token == "eos":
        stop_token_id = tokenizer.eos_token_id
    suppressed = suppressed_token_ids(stop_token_id, tokenizer, policy_generation_config)
    suppressed_ids = torch.tensor(suppressed, dtype=torch.long) if suppressed else None
    return stop_token_id, suppressed_ids, make_generation_config(args, tokenizer, stop_token_id, suppressed)


def make_generation_config(args, tokenizer, stop_token_id: int | None, suppressed: list[int] = ()) -> GenerationConfig:
    """Sampling configuration of the rollout: pure temperature sampling (no top-k / top-p), so that the
    sampling distribution is exactly `softmax(logits / T)` over the tokens not in `suppressed`, the one
    that is scored (`response_logits` with the same `suppressed`)."""
    kwargs = dict(
        max_new_tokens=args.response_length,
        do_sample=True,
        temperature=args.temperature,
        top_k=0,
        top_p=1.0,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
    )
    if stop_token_id is None:
        # fixed length: never sample an end-of-sequence token (so generation never stops early)
        if suppressed:
            kwargs["suppress_tokens"] = list(suppressed)
    else:
        kwargs["eos_token_id"] = stop_token_id
    return GenerationConfig(**kwargs)


@contextmanager
def contiguous_lm_head_input(model):
    """Make the input of `model`'s LM head contiguous inside the block. Generation's first step runs the head on
    `hidden_states[:, -1:]`, a strided view that matmul takes down its batched path: 3-4x the time of the same
    product on a contiguous copy on CPU (SmolLM2, 8 prompts, 49,152-token vocabulary). The logits are the same."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        yield
        return
    handle = head.register_forward_pre_hook(lambda module, args: (args[0].contiguous(), *args[1:]) if args else None)
    try:
        yield
    finally:
        handle.remove()


def _mergeable_lora_layers(model) -> list | None:
    """The LoRA layers of a PEFT `model` when every one is a plain `lora.Linear` whose active adapters can be
    merged into a floating-point base weight of its own; None when none exists or any layer is otherwise (quantized
    base layers, LoRA variants such as DoRA or aLoRA, `target_parameters` wrappers, or a base weight shared with
    another parameter, as tied embeddings are: merging one module's update would change the other's)."""
    try:
        from peft.tuners.lora import LoraLayer
        from peft.tuners.lora import Linear as LoraLinear
    except ImportError:
        return None
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    storages = Counter(p.data_ptr() for _, p in model.named_parameters(remove_duplicate=False))
    for layer in layers:
        base = layer.get_base_layer()
        weight = getattr(base, "weight", None)
        if type(layer) is not LoraLinear or layer.merged or getattr(layer, "disable_adapters", False):
            return None
        if getattr(layer, "lora_variant", None) or getattr(layer, "parameter_name", None):
            return None
        if type(weight) is not nn.Parameter or not weight.is_floating_point() or storages[weight.data_ptr()] != 1:
            return None
    return layers or None


@contextmanager
def merged_lora(model):
    """Sample from `model` with its active LoRA adapters merged into the base weights, then give the base weights
    back bit for bit.

    An unmerged LoRA layer runs its base matmul plus two small ones and a few elementwise ops; over the hundreds
    of LoRA layers and the dozens of decoding steps of one rollout, that overhead is a large part of generation on
    CPU. Merging (PEFT's own `merge`) writes `W + B A * scale` into a fresh copy of each base weight; the original
    tensors are put back afterwards, so the base model (which is the reference when the adapter is disabled) never
    changes, not even by rounding, as subtracting the update again would. The copies cost one extra set of the
    targeted base weights while sampling. The logits differ from the unmerged model's by rounding only (about
    1e-5 to 1e-4 in float32). No-op for a model without LoRA layers, or with a layer whose base weight is not a plain
    floating-point parameter of its own (see `_mergeable_lora_layers`: those keep the unmerged path)."""
    layers = _mergeable_lora_layers(model)
    if not layers:
        yield
        return
    saved = []
    try:
        for layer in layers:
            base = layer.get_base_layer()
            bias = getattr(base, "bias", None)
            saved.append((layer, base, base.weight.data, None if bias is None else bias.data, list(layer.merged_adapters)))
            base.weight.data = base.weight.data.clone()
            if bias is not None:
                bias.data = bias.data.clone()
            with torch.no_grad():
                layer.merge()  # in place, on the copies
        yield
    finally:
        for layer, base, weight, bias, merged in reversed(saved):
            base.weight.data = weight
            if bias is not None:
                base.bias.data = bias
            layer.merged_adapters = merged


def sample_categorical(probs: torch.Tensor, block: int = 256, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of `probs [B, V]` (non-negative, each row with a positive sum; need not be normalised),
    drawn by inverse transform sampling in two levels: a block of `block` tokens by its cumulative mass, then a
    token inside it. Exact up to float64 rounding of the cumulative sums, and never a token of probability 0.

    The same distribution as `torch.multinomial(probs, 1)`, which on CPU draws an exponential variate for every
    entry: 12-14 ms per decoding step for 8 x 49,152 probabilities on one thread, against 1 ms here. One uniform
    variate per row is taken from `generator` (torch's default generator when None), so seeded runs repeat.
    """
    rows, vocab = probs.shape
    pad = (-vocab) % block
    blocks = torch.nn.functional.pad(probs, (0, pad)).view(rows, -1, block)  # [B, n, block]
    mass = blocks.sum(-1, dtype=torch.float64).cumsum(-1)  # [B, n]
    u = torch.rand(rows, 1, dtype=torch.float64, device=probs.device, generator=generator) * mass[:, -1:]
    # the first block whose cumulative mass passes u; u reaching the total by rounding takes the last non-empty one
    last_block = (mass < mass[:, -1:]).sum(-1, keepdim=True)
    b = torch.minimum(torch.searchsorted(mass, u, right=True), last_block)  # [B, 1]
    before = torch.where(b > 0, mass.gather(1, (b - 1).clamp(min=0)), torch.zeros_like(u))
    inside = blocks.gather(1, b.unsqueeze(-1).expand(rows, 1, block)).squeeze(1)  # [B, block]
    cumulative = inside.cumsum(-1, dtype=torch.float64)
    last_token = (cumulative < cumulative[:, -1:]).sum(-1, keepdim=True)
    j = torch.minimum(torch.searchsorted(cumulative, u - before, right=True), last_token)
    return (b * block + j).squeeze(1)


class InverseCDFSampler(LogitsProcessor):
    """Temperature sampling as the last logits processor of a greedy `generate`: draws the token from
    `softmax(scores / temperature)` with `sample_categorical` and returns scores whose only finite entry is that
    token, which the greedy step then picks. The draws follow the distribution of `do_sample=True` with the same
    temperature (and no truncation), without `torch.multinomial`'s cost on CPU. Generation's raw logits
    (`output_logits`) are untouched; its `output_scores` would hold the one-hot scores.

    Non-finite probabilities (NaN or +inf logits, or a row with every token masked) are noted on the device, with
    no host sync per decoding step; `raise_if_nonfinite` after `generate` raises as `torch.multinomial` does (a
    message naming inf and nan, which `clear_sampling_errors` explains)."""

    def __init__(self, temperature: float):
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.temperature = float(temperature)
        self.nonfinite = None  # a device bool: any non-finite probability since the last check

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(scores.float() / self.temperature, dim=-1)
        bad = ~torch.isfinite(probs).all()
        self.nonfinite = bad if self.nonfinite is None else self.nonfinite | bad
        token = sample_categorical(probs)
        return torch.full_like(scores, float("-inf")).scatter_(1, token[:, None], 0.0)

    def raise_if_nonfinite(self) -> None:
        nonfinite, self.nonfinite = self.nonfinite, None
        if nonfinite is not None and bool(nonfinite):  # one sync per `generate` call
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")


# settings under which `do_sample=True` is plain temperature sampling: each field's value (after the model's own
# generation config fills the unset ones, as `generate` does) must be one of these
_UNTRUNCATED = {
    "top_k": (0,),  # unset means transformers' default of 50
    "top_p": (None, 1.0),
    "min_p": (None, 0.0),
    "typical_p": (None, 1.0),
    "epsilon_cutoff": (None, 0.0),
    "eta_cutoff": (None, 0.0),
    "top_h": (None,),
    "num_beams": (None, 1),
    "num_return_sequences": (None, 1),
    "penalty_alpha": (None,),
    "watermarking_config": (None,),
    "prompt_lookup_num_tokens": (None,),
}


def inverse_cdf_sampling(
    generation_config: GenerationConfig, model_generation_config: GenerationConfig | None = None
) -> tuple[GenerationConfig, LogitsProcessorList | None]:
    """`(config, logits_processor)` for `generate`: plain temperature sampling (no top-k / top-p / min-p / typical /
    epsilon / eta / top-h truncation, one beam, one sequence per prompt, no watermark or prompt lookup), judged after
    `model_generation_config` (the model's `generation_config`) fills the fields `generation_config` leaves unset,
    becomes greedy decoding with an `InverseCDFSampler` last, which draws from the same distribution. Any other
    configuration is returned as it is, with no processor, and samples with `torch.multinomial`."""
    merged = copy.deepcopy(generation_config)
    if model_generation_config is not None:
        merged.update(**model_generation_config.to_dict(), defaults_only=True)
    if not merged.do_sample or any(getattr(merged, k, None) not in ok for k, ok in _UNTRUNCATED.items()):
        return generation_config, None
    sampler = InverseCDFSampler(merged.temperature if merged.temperature is not None else 1.0)
    greedy = copy.deepcopy(merged)
    # neutral values: a greedy config that sets sampling flags makes transformers warn that they are ignored
    greedy.do_sample, greedy.temperature, greedy.top_p, greedy.top_k = False, 1.0, 1.0, None
    return greedy, LogitsProcessorList([sampler])


@torch.no_grad()
def generate_responses(
    policy,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    generation_config: GenerationConfig,
    chunk: int,
    temperature: float | None = None,
    value_head=None,
    suppressed: torch.Tensor | None = None,
    keep_logits: bool = False,
    synced: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, list[torch.Tensor] | None]:
    """Sample responses for left-padded prompts in chunks of `chunk` sequences.

    With `temperature`, the log-probs of the sampled tokens under `softmax(logits / temperature)` are read
    from the generation's own logits, so scoring needs no second policy forward pass; with `value_head` too,
    the values of the states before each token come from the generation's last hidden states (a shared
    critic). `suppressed` token ids are masked out of the scored log-softmax, as in `response_logits`.
    Full-vocabulary logits exist for one chunk at a time, unless `keep_logits` (with `temperature`) returns
    them: the scaled, masked logits of each chunk, for a logits-based KL statistic without a scoring pass.
    `synced` keeps every rank generating until all have finished (`synced_gpus`): sharded weights (FSDP) need
    every rank in every forward pass.

    Returns:
        `(responses [B, R], logp [B, R] or None, values [B, R] or None, logits)`, right-padded (pad token /
        0), R <= `max_new_tokens`; `logits` is None or one `[chunk, R_chunk, V]` tensor per chunk
        (`R_chunk <= R`: a chunk stops when all its sequences have).
    """
    pad = generation_config.pad_token_id
    with_scores = temperature is not None
    generation_config, processors = inverse_cdf_sampling(generation_config, getattr(policy, "generation_config", None))
    generation_config = copy.deepcopy(generation_config)
    generation_config.return_dict_in_generate = True
    generation_config.output_logits = with_scores
    with_values = with_scores and value_head is not None
    pieces, logps, values, kept = [], [], [], []
    for start in range(0, input_ids.shape[0], chunk):
        with last_hidden_states(policy) if with_values else nullcontext() as hidden:
            out = policy.generate(
                input_ids=input_ids[start : start + chunk],
                attention_mask=attention_mask[start : start + chunk],
                generation_config=generation_config,
                logits_processor=processors,
                synced_gpus=synced or None,  # None: transformers decides (on under DeepSpeed ZeRO-3)
            )
        if processors is not None:
            processors[0].raise_if_nonfinite()
        tokens = out.sequences[:, input_ids.shape[1] :]
        pieces.append(tokens)
        if with_scores:
            step_logits = mask_suppressed(torch.stack(out.logits, dim=1) / temperature, suppressed, inplace=True)  # [b, R, V]
            logps.append(response_logprobs(step_logits, tokens))
            if keep_logits:
                kept.append(step_logits)
            del step_logits
            if with_values:
                # the last hidden state at the last position of every step: the state before each token
                last = torch.stack([step[:, -1] for step in hidden[: tokens.shape[1]]], dim=1)
                values.append(value_head(last).float())
        del out

    def cat(parts, value):
        width = max(p.shape[1] for p in parts)
        return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1]), value=value) for p in parts], dim=0)

    logp_out, values_out = cat(logps, 0.0) if logps else None, cat(values, 0.0) if values else None
    return cat(pieces, pad), logp_out, values_out, kept if keep_logits and with_scores else None


def response_positions(response_length: int, length: int, device) -> torch.Tensor:
    """`logits_to_keep` for a forward pass over `length` positions whose last `response_length` tokens are the
    response: the indices of the positions that predict those tokens, `length - response_length - 1` to
    `length - 2`. The LM head then runs on these positions only: not on the prompt, and not on the last position,
    which predicts past the response.

    An index tensor rather than an int: for an int, transformers' causal LMs run their LM head on
    `hidden_states[:, -n:]`, a strided view that matmul cannot fold into one matrix product; it takes a batched
    path that cost 1.5-1.8x the LM head's forward and backward time on CPU (SmolLM2, 8 x 25 positions,
    49,152-token vocabulary). And the logits are exactly the response's, so no slice of them has to be
    differentiated (a slice's backward fills a zero gradient of the whole logits tensor first).
    """
    if length <= response_length:
        raise ValueError(f"{length} positions cannot hold a prompt and a response of {response_length} tokens.")
    return torch.arange(length - response_length - 1, length - 1, device=device)


def response_logits(
    logits: torch.Tensor, response_length: int, temperature: float, suppressed: torch.Tensor | None = None
) -> torch.Tensor:
    """Logits that predict the `response_length` response tokens, scaled by the sampling temperature, with
    the `suppressed` token ids (never sampled) masked out.

    `logits` is `[B, response_length, V]`, from a forward pass with `logits_to_keep=response_positions(...)`
    (the LM head on the predicting positions only), or `[B, L, V]` for the whole sequence of `L >
    response_length` positions; either way the result is `[B, response_length, V]`.
    """
    if logits.shape[1] != response_length:
        logits = logits[:, -(response_length + 1) : -1]
    if temperature == 1.0:
        return mask_suppressed(logits, suppressed)
    return mask_suppressed(logits / temperature, suppressed, inplace=True)  # the quotient is a new tensor


def mask_suppressed(scaled_logits: torch.Tensor, suppressed: torch.Tensor | None, inplace: bool = False) -> torch.Tensor:
    """`scaled_logits [..., V]` with the `suppressed` ids set to the dtype's lowest finite value: their
    probability is exactly 0 after softmax, and entropy / full-vocabulary KL stay finite (a `-inf` would
    give `0 * inf`). Differentiable; out of place unless `inplace` (for a tensor the caller has just made, which
    spares a copy of the logits); no-op when `suppressed` is None or empty."""
    if suppressed is None or suppressed.numel() == 0:
        return scaled_logits
    fill = scaled_logits.index_fill_ if inplace else scaled_logits.index_fill
    return fill(-1, suppressed.to(scaled_logits.device), torch.finfo(scaled_logits.dtype).min)


def response_logprobs(scaled_logits: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """Log-probs of `responses [B, R]` under `scaled_logits [B, R, V]` (memory-light log-softmax + gather)."""
    return selective_log_softmax(scaled_logits, responses)
