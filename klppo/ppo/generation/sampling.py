"""Sampling responses: the stop token and the suppressed ids, plain temperature sampling as a logits processor that
reads the sampled tokens' log-probs as it goes, `generate_responses` (one `generate` call per rollout), and stop-token
truncation and masks."""

from __future__ import annotations

import copy
import inspect
from contextlib import contextmanager, nullcontext
from typing import NamedTuple

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from ..actor_critic import last_hidden_states
from ..safety.nonfinite import TrainingDiverged

DIVERGED_SAMPLING = (
    "The policy's logits are not finite, so no response can be sampled: its weights have diverged. Lower the "
    "learning rate or max_grad_norm, raise the KL coefficient, or use bf16/fp32 instead of fp16; resume from the "
    "last checkpoint (checkpoints written so far are intact)."
)


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


def eos_scored_as_any_token(args, stop_token_id: int | None) -> bool:
    """Whether a run samples and scores the end-of-sequence token like any other token, without ending responses
    there: `missing_eos_penalty` with no stop token, TRL 1.12's meaning of that combination. Responses then run to
    `response_length` tokens, nothing is suppressed, and the penalty goes to each response that contains no EOS
    token anywhere (`KLPPOTrainer.compute_rewards`). Without a stop token and without that penalty, responses have
    a fixed length and EOS is suppressed instead (`suppressed_token_ids`)."""
    return stop_token_id is None and getattr(args, "missing_eos_penalty", None) is not None


def contains_token(responses: torch.Tensor, mask: torch.Tensor, token_id: int) -> torch.Tensor:
    """`[B]` bool: whether each response holds `token_id` anywhere among its valid tokens."""
    return ((responses == token_id) & mask.bool()).any(dim=1)


def suppressed_token_ids(
    stop_token_id: int | None, tokenizer, model_generation_config=None, eos_scored: bool = False
) -> list[int]:
    """Token ids that generation never samples: the end-of-sequence ids when responses have a fixed length
    (`stop_token_id` None), else none; none either with `eos_scored` (`eos_scored_as_any_token`: EOS is then
    sampled and scored like any other token, and does not end the response).

    Responses of fixed length must not end early, so the end-of-sequence tokens (the tokenizer's and the
    model's generation config's) are suppressed while sampling. The same ids are masked out of every
    log-softmax that is scored (`response_logits`), so the trained distribution is exactly the sampled one;
    scoring the raw logits instead would let the suppressed tokens' probability drift unseen, and the model
    would later emit them whenever they are allowed. With `eos_scored` nothing is masked, in sampling or scoring.
    """
    if stop_token_id is not None or eos_scored:
        return []
    ids = {tokenizer.eos_token_id}
    model_eos = getattr(model_generation_config, "eos_token_id", None)
    ids.update(model_eos if isinstance(model_eos, (list, tuple)) else [model_eos])
    return sorted(i for i in ids if i is not None)


def sampling_setup(args, tokenizer, policy_generation_config=None):
    """`(stop_token_id, suppressed_ids, generation_config)` of a run: the stop token (TRL's `stop_token_id` where the
    config has one, else `stop_token`: EOS for `"eos"`, the token of that text otherwise, or None for fixed-length
    responses), the token ids never sampled as a tensor (or None: with a stop token, or with `missing_eos_penalty`
    and none, `eos_scored_as_any_token`) and the sampling configuration."""
    stop_token_id = getattr(args, "stop_token_id", None)
    if stop_token_id is None and args.stop_token == "eos":
        stop_token_id = tokenizer.eos_token_id
    elif stop_token_id is None and args.stop_token is not None:
        stop_token_id = tokenizer.convert_tokens_to_ids(args.stop_token)
        if stop_token_id is None or (
            stop_token_id == tokenizer.unk_token_id and args.stop_token != tokenizer.unk_token
        ):
            raise ValueError(
                f"`stop_token`={args.stop_token!r} is not one token of this tokenizer. Use 'eos', the text of one "
                f"token (e.g. {tokenizer.eos_token!r}), or None for fixed-length responses."
            )
    eos_scored = eos_scored_as_any_token(args, stop_token_id)
    suppressed = suppressed_token_ids(stop_token_id, tokenizer, policy_generation_config, eos_scored=eos_scored)
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
        **NEUTRAL_PROCESSORS,  # so that a model's generation config cannot add a processor that reshapes the logits
    )
    if stop_token_id is None:
        # fixed length: no token ends a response (an empty list, so that `generate` does not fill in the model's
        # own EOS ids), and the suppressed ones are never sampled
        kwargs["eos_token_id"] = []
        if suppressed:
            kwargs["suppress_tokens"] = list(suppressed)
    else:
        kwargs["eos_token_id"] = stop_token_id
    return GenerationConfig(**kwargs)


@contextmanager
def contiguous_lm_head_input(model):
    """Make the input of `model`'s LM head contiguous inside the block. Generation's first step runs the head on
    `hidden_states[:, -1:]`, a strided view that matmul takes down its slower batched path (on CPU: timings in
    `docs/results.md`, "Speed and memory"). The logits are the same."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        yield
        return
    handle = head.register_forward_pre_hook(lambda module, args: (args[0].contiguous(), *args[1:]) if args else None)
    try:
        yield
    finally:
        handle.remove()


def sample_categorical(probs: torch.Tensor, block: int = 256, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of `probs [B, V]` (non-negative, each row with a positive sum; need not be normalised),
    drawn by inverse transform sampling in two levels: a block of `block` tokens by its cumulative mass, then a
    token inside it. Exact up to float64 rounding of the cumulative sums, and never a token of probability 0.

    The same distribution as `torch.multinomial(probs, 1)`, which on CPU draws an exponential variate for every
    entry, a far larger cost per decoding step (timings in `docs/results.md`, "Speed and memory"). One uniform
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


def sample_exponential_race(weights: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of `weights [B, V]` (non-negative, each row with a positive sum; need not be normalised):
    the index of the largest `weights / E`, with `E` independent Exp(1) variates. Token `i` wins with probability
    `w_i / sum(w)` (the race of exponential clocks with rates `w_i`), and a token of weight 0 never does. Two
    elementwise kernels and an argmax: the draw `torch.multinomial` makes inside, without its bookkeeping."""
    race = torch.empty_like(weights).exponential_(generator=generator).clamp_(min=torch.finfo(weights.dtype).tiny)
    return (weights / race).argmax(dim=-1)


# how a `TemperatureSampler` draws, per device type (`default_draw`): on a CPU, inverse transform sampling takes a
# small fraction of the time of `torch.multinomial` or the race, which draw an exponential variate per entry; on a
# GPU the race is two elementwise kernels and an argmax. `benchmarks/sampling.py` times the three on any device.
DRAWS = {"inverse_cdf": sample_categorical, "exponential_race": sample_exponential_race}


def default_draw(device: torch.device | str) -> str:
    """The draw a `TemperatureSampler` uses on `device`: inverse transform sampling on a CPU, the race elsewhere."""
    return "inverse_cdf" if torch.device(device).type == "cpu" else "exponential_race"


class TemperatureSampler(LogitsProcessor):
    """Temperature sampling as the last logits processor of a greedy `generate`, reading what scoring needs as it
    goes.

    At each decoding step it draws the token from `softmax(scores / temperature)` (after the processors before it,
    such as the suppression of end-of-sequence tokens) with `DRAWS[draw]`, and returns scores whose only finite
    entry is that token, which the greedy step then picks: the draws follow `do_sample=True` with the same
    temperature and no truncation. With `record_logprobs` it keeps the drawn token's log-probability (one `[B]`
    tensor per step, no full-vocabulary tensor kept); with `keep_logits`, the scaled logits of each step `[B, V]`,
    their suppressed entries (-inf) set to the lowest finite value as in `mask_suppressed`. Tokens generation then
    replaces by padding (sequences already finished) get entries that the response mask drops.

    Non-finite logits (NaN or +inf, or a row with every token masked) are noted in `nonfinite`, a device bool, with
    no host sync per decoding step."""

    def __init__(
        self, temperature: float, draw: str = "inverse_cdf", record_logprobs: bool = False, keep_logits: bool = False
    ):
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if draw not in DRAWS:
            raise ValueError(f"draw must be one of {', '.join(DRAWS)}, got {draw!r}")
        self.temperature, self.draw = float(temperature), draw
        self.record_logprobs, self.keep_logits = record_logprobs, keep_logits
        self.logprobs: list[torch.Tensor] = []
        self.logits: list[torch.Tensor] = []
        self.nonfinite = torch.tensor(False)  # on the device after the first step: any non-finite logits

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scaled = scores.float() / self.temperature
        top = scaled.amax(dim=-1, keepdim=True)
        bad = ~torch.isfinite(top).all()
        self.nonfinite = bad | self.nonfinite.to(bad.device)
        weights = (scaled - top).exp_()  # softmax up to its normaliser, which neither draw needs
        token = DRAWS[self.draw](weights)[:, None]
        if self.record_logprobs:
            log_norm = top + weights.sum(dim=-1, keepdim=True).log()
            self.logprobs.append((scaled.gather(1, token) - log_norm).squeeze(1))
        if self.keep_logits:
            self.logits.append(scaled.clamp_(min=torch.finfo(scaled.dtype).min))
        return torch.full_like(scores, float("-inf")).scatter_(1, token, 0.0)


# logits processors that `generate` would add from a model's own generation config, set to values that add none
# (`min_new_tokens=0` overrides any `min_length`: `generate` then sets it to the prompt's length, which masks
# nothing; setting both makes `generate` warn at every call)
NEUTRAL_PROCESSORS = {
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "min_new_tokens": 0,
    "bad_words_ids": None,
    "sequence_bias": None,
    "exponential_decay_length_penalty": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "begin_suppress_tokens": None,
}


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
    "min_length": (None, 0),
    # the processors: unset, or the value that adds none
    **{name: (None,) if neutral is None else (None, neutral) for name, neutral in NEUTRAL_PROCESSORS.items()},
}


def plain_sampling_temperature(
    generation_config: GenerationConfig, model_generation_config: GenerationConfig | None = None
) -> float | None:
    """The temperature of `generation_config` when it is plain temperature sampling (no top-k / top-p / min-p /
    typical / epsilon / eta / top-h truncation, one beam, one sequence per prompt, no watermark or prompt lookup, and
    no processor that reshapes the logits: repetition or n-gram penalties, a minimum length, banned or biased words,
    forced tokens), judged after `model_generation_config` (the model's `generation_config`) fills the fields
    `generation_config` leaves unset, as `generate` does; None for any other configuration."""
    merged = copy.deepcopy(generation_config)
    if model_generation_config is not None:
        merged.update(**model_generation_config.to_dict(), defaults_only=True)
    if merged.min_new_tokens is not None:  # it takes precedence: `generate` derives `min_length` from it
        merged.min_length = None
    if not merged.do_sample or any(getattr(merged, k, None) not in ok for k, ok in _UNTRUNCATED.items()):
        return None
    return merged.temperature if merged.temperature is not None else 1.0


def greedy_form(generation_config: GenerationConfig) -> GenerationConfig:
    """`generation_config` as greedy decoding, for a `TemperatureSampler` to draw the tokens; the sampling flags
    are set to neutral values (a greedy config that sets them makes transformers warn that they are ignored)."""
    greedy = copy.deepcopy(generation_config)
    greedy.do_sample, greedy.temperature, greedy.top_p, greedy.top_k = False, 1.0, 1.0, None
    return greedy


class Generation(NamedTuple):
    """What `generate_responses` returns: `tokens [B, R]` right-padded with the pad token (R <= `max_new_tokens`:
    generation stops when every sequence has), and when asked for, the sampled tokens' `logp [B, R]`, a shared
    critic's `values [B, R]` and the scaled `logits [B, R, V]`; `finite` is False when some sampling logits were
    not (the tokens are then meaningless)."""

    tokens: torch.Tensor
    logp: torch.Tensor | None = None
    values: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    finite: bool = True


@torch.no_grad()
def generate_responses(
    policy,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    generation_config: GenerationConfig,
    with_logprobs: bool = False,
    value_head=None,
    keep_logits: bool = False,
    synced: bool = False,
    draw: str | None = None,
    check_finite: bool = True,
    cache=None,
) -> Generation:
    """Sample responses for left-padded prompts, all in one `generate` call.

    `generation_config` must be plain temperature sampling (`plain_sampling_temperature`): a `TemperatureSampler`
    draws the tokens (`draw`: see `DRAWS`; None picks `default_draw` for the policy's device). With
    `with_logprobs`, the log-probs of the sampled tokens under `softmax(logits / T)` (without the suppressed tokens)
    are read at each decoding step, so scoring needs no second policy forward pass; with `value_head` too, the
    values of the states before each token come from the generation's last hidden states (a shared critic). No
    full-vocabulary tensor outlives its decoding step unless `keep_logits` returns them all: the scaled logits, for
    a logits-based KL statistic without a scoring pass. `synced` keeps every rank generating until all have
    finished (`synced_gpus`): sharded weights (FSDP) need every rank in every forward pass. Non-finite sampling
    logits give `finite=False` with `check_finite=False` (the trainer's way: it decides alike on every rank after
    reducing the flag), else a `TrainingDiverged` that says what it means. `cache`:
    a KV cache to decode into (a `StaticCache` from `StaticCaches`), reset first; None: `generate`'s own.
    """
    temperature = plain_sampling_temperature(generation_config, getattr(policy, "generation_config", None))
    if temperature is None:
        raise ValueError(
            "klppo samples with plain temperature sampling (the distribution it scores); the generation config "
            f"truncates or reshapes it: {generation_config.to_diff_dict()}"
        )
    device = input_ids.device
    sampler = TemperatureSampler(
        temperature, draw or default_draw(device), record_logprobs=with_logprobs, keep_logits=keep_logits
    )
    cache_kwargs = {}
    if cache is not None:
        cache.reset()
        # the keyword's name: `cache` in transformers >= 5.20 (which deprecates `past_key_values`), before it the other
        forward = policy.get_base_model().forward if hasattr(policy, "get_base_model") else policy.forward
        cache_kwargs["cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"] = cache
    capture = with_logprobs and value_head is not None
    with last_hidden_states(policy, last_position=True) if capture else nullcontext() as hidden:
        sequences = policy.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=greedy_form(generation_config),
            logits_processor=LogitsProcessorList([sampler]),
            synced_gpus=synced or None,  # None: transformers decides (on under DeepSpeed ZeRO-3)
            **cache_kwargs,
        )
    finite = not bool(sampler.nonfinite)  # one host sync per rollout
    if check_finite and not finite:
        raise TrainingDiverged(DIVERGED_SAMPLING)
    tokens = sequences[:, input_ids.shape[1] :]
    width = tokens.shape[1]  # synced ranks may step past their own last token: those steps are dropped
    logp = torch.stack(sampler.logprobs[:width], dim=1) if with_logprobs else None
    logits = torch.stack(sampler.logits[:width], dim=1) if keep_logits else None
    values = None
    if hidden is not None:  # the last hidden state at the last position of every step: the state before each token
        values = value_head(torch.stack(hidden[:width], dim=1)).float()
    return Generation(tokens, logp, values, logits, finite)
