"""Log-probs of sampled responses from logits: the positions that predict the response, temperature scaling, the
suppressed tokens masked out, the memory-light log-softmax + gather; and the LM head read in blocks of positions
(`ResponseLogits`, `read_response`), which scoring, the PPO loss and the finiteness check use."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint
from trl.trainer.utils import entropy_from_logits, selective_log_softmax


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids for left-padded sequences: `cumsum(mask) - 1`, clamped at 0 on padding. `[B, L]`."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def response_positions(response_length: int, length: int, device) -> torch.Tensor:
    """`logits_to_keep` for a forward pass over `length` positions whose last `response_length` tokens are the
    response: the indices of the positions that predict those tokens, `length - response_length - 1` to
    `length - 2`. The LM head then runs on these positions only: not on the prompt, and not on the last position,
    which predicts past the response.

    An index tensor rather than an int: for an int, transformers' causal LMs run their LM head on
    `hidden_states[:, -n:]`, a strided view that matmul cannot fold into one matrix product; it takes a slower
    batched path (on CPU: timings in `docs/results.md`, "Speed and memory"). And the logits are exactly the
    response's, so no slice of them has to be differentiated (a slice's backward fills a zero gradient of the
    whole logits tensor first).
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


def mask_suppressed(
    scaled_logits: torch.Tensor, suppressed: torch.Tensor | None, inplace: bool = False
) -> torch.Tensor:
    """`scaled_logits [..., V]` with the `suppressed` ids set to the dtype's lowest finite value: their
    probability is exactly 0 after softmax, and entropy / full-vocabulary KL stay finite (a `-inf` would
    give `0 * inf`). Differentiable; out of place unless `inplace` (for a tensor the caller has just made, which
    spares a copy of the logits); no-op when `suppressed` is None or empty."""
    if suppressed is None or suppressed.numel() == 0:
        return scaled_logits
    fill = scaled_logits.index_fill_ if inplace else scaled_logits.index_fill
    return fill(-1, suppressed.to(scaled_logits.device), torch.finfo(scaled_logits.dtype).min)


# ---------------------------------------------------------------------------------------------------------------------
# Reading the LM head in blocks of positions
#
# A response of R tokens over a vocabulary of V has `[B, R, V]` logits: at R = 2,048 and V = 152k, 64 rows of them
# are 80 GB in float32. Everything klppo reads from them per token (the sampled token's log-prob, the entropy, the
# exact KL to the reference) needs one position's logits at a time, so the LM head runs on a block of positions
# at a time, and only `[B, R]` results are kept. With a gradient, each block is checkpointed: its logits are made
# again in the backward pass instead of being kept (the approach of verl's `FusedLinearForPPO` and Liger-Kernel's
# chunked losses), so the training pass holds one block's logits and their gradient at once.


def head_transform(config):
    """What a causal LM's forward does to its LM head's output before returning the logits, as a function of the
    head's output (None: nothing): Gemma 2/3's final soft-capping `cap * tanh(x / cap)`, Cohere's `logit_scale`,
    Granite's `logits_scaling`. A model whose forward does something else is found out by `ActorCritic`'s check of
    its first forward pass, which then reads the model's own logits."""
    text_config = getattr(config, "text_config", None) or config
    cap = getattr(text_config, "final_logit_softcapping", None)
    if cap:
        return lambda x: torch.tanh(x / cap) * cap
    scale = getattr(text_config, "logit_scale", None)
    if isinstance(scale, (int, float)) and scale != 1.0:
        return lambda x: x * scale
    scaling = getattr(text_config, "logits_scaling", None)
    if isinstance(scaling, (int, float)) and scaling != 1.0:
        return lambda x: x / scaling
    return None


class ResponseLogits:
    """The logits at a response's R predicting positions, `[B, R, V]`, made one block of positions at a time:
    through an LM head from the last hidden states `[B, R, H]` (`from_hidden`), or sliced from logits already made
    (`from_logits`: a model whose head `head_transform` does not know, or the generation's kept logits, which are
    `scaled` by the temperature already). `block(positions, temperature, suppressed)` returns that block's logits
    scaled, the suppressed ids masked (`response_logits`)."""

    def __init__(self, vocab: int, hidden=None, head=None, logits=None, scaled: bool = False):
        if (hidden is None) == (logits is None):
            raise ValueError("ResponseLogits takes either hidden states and a head, or logits.")
        self.vocab, self.hidden, self.head, self.logits, self.scaled = vocab, hidden, head, logits, scaled
        source = hidden if hidden is not None else logits
        self.rows, self.length = source.shape[0], source.shape[1]

    @classmethod
    def from_hidden(cls, hidden: torch.Tensor, head, vocab: int) -> "ResponseLogits":
        return cls(vocab, hidden=hidden, head=head)

    @classmethod
    def from_logits(cls, logits: torch.Tensor, scaled: bool = False) -> "ResponseLogits":
        return cls(logits.shape[-1], logits=logits, scaled=scaled)

    @property
    def requires_grad(self) -> bool:
        return (self.hidden if self.hidden is not None else self.logits).requires_grad

    def block(self, positions: slice, temperature: float, suppressed: torch.Tensor | None = None) -> torch.Tensor:
        if self.logits is not None:
            logits = self.logits[:, positions]
            return logits if self.scaled else response_logits(logits, logits.shape[1], temperature, suppressed)
        hidden = self.hidden[:, positions]
        logits = self.head(hidden if hidden.is_contiguous() else hidden.contiguous())  # matmul's fast path
        return response_logits(logits, logits.shape[1], temperature, suppressed)


def block_positions(rows: int, vocab: int, budget_mb: float) -> int:
    """Positions per block such that one block's float32 logits, `rows x positions x vocab`, fit in `budget_mb` MiB
    (at least one position)."""
    return max(1, int(budget_mb * 2**20 // (4 * max(rows, 1) * vocab)))


def read_response(
    policy: ResponseLogits,
    responses: torch.Tensor,
    temperature: float,
    suppressed: torch.Tensor | None,
    budget_mb: float,
    reference: ResponseLogits | None = None,
    estimates: dict | None = None,
    entropy: bool = False,
    finite: bool = False,
) -> dict[str, torch.Tensor]:
    """What a PPO update reads from the logits at each response position, a block of positions at a time, as
    `[B, R]` tensors, every logit scaled by `temperature` with the `suppressed` ids masked (`response_logits`):

    - `logp`: the log-prob of `responses [B, R]` under the policy (differentiable when the policy's logits are);
    - `ref_logp`, with `reference`: the same under the reference (no gradient);
    - each of `estimates {name: fn(logits, ref_logits) -> [B, r]}`, with `reference`: a KL read from both blocks'
      logits (`full`; its gradient reaches the policy's logits);
    - `entropy` (no gradient), `finite` (bool: every logit of the position is finite), when asked for.

    A block holds `block_positions(B, V, budget_mb)` positions. With a gradient and more than one block, each block
    is checkpointed (`torch.utils.checkpoint`): the backward pass makes its logits again, so no more than one
    block's logits, their log-softmax and their gradient are alive at once. One block computes exactly what one
    pass over all positions does."""
    estimates = estimates or {}
    step = block_positions(policy.rows, policy.vocab, budget_mb)

    def read(positions: slice) -> dict[str, torch.Tensor]:
        logits = policy.block(positions, temperature, suppressed)
        out = {"logp": selective_log_softmax(logits, responses[:, positions])}
        if entropy or finite:
            with torch.no_grad():
                if entropy:
                    out["entropy"] = entropy_from_logits(logits.detach())
                if finite:
                    out["finite"] = torch.isfinite(logits).all(dim=-1)
        if reference is not None:
            with torch.no_grad():
                ref_logits = reference.block(positions, temperature, suppressed)
                out["ref_logp"] = selective_log_softmax(ref_logits, responses[:, positions])
            for name, fn in estimates.items():
                out[name] = fn(logits, ref_logits)
        return out

    blocks = [slice(start, start + step) for start in range(0, policy.length, step)]
    if len(blocks) == 1:
        return read(blocks[0])
    checkpointed = torch.is_grad_enabled() and policy.requires_grad
    parts = [checkpoint(read, b, use_reentrant=False) if checkpointed else read(b) for b in blocks]
    return {key: torch.cat([p[key] for p in parts], dim=1) for key in parts[0]}
