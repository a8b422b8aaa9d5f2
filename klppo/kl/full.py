"""The exact KL between two categorical distributions over the whole vocabulary, from logits, computed in chunks so
that memory stays O(chunk_size x V) in the forward and the backward pass. Registered as the ``full`` estimator in
``klppo.kl.estimators``."""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

__all__ = ["full_kl"]


def _full_kl_rows(x: torch.Tensor, y: torch.Tensor):
    """Exact KL(softmax(x) || softmax(y)) over the last dim. ``[..., V] -> [...]`` plus pieces."""
    logp = torch.log_softmax(x, dim=-1)
    logq = torch.log_softmax(y, dim=-1)
    p = logp.exp()
    # 0 * log 0 = 0: tokens that the policy cannot emit contribute nothing (avoids -inf - -inf).
    terms = torch.where(p > 0, p * (logp - logq), torch.zeros((), dtype=p.dtype, device=p.device))
    return terms.sum(-1), p, logp, logq


def _blocks(a: int, t: int, chunk_size: int):
    """Yield (a0, a1, t0, t1) blocks of an [A, T] grid holding at most ``chunk_size`` positions."""
    if t >= chunk_size:
        for i in range(a):
            for t0 in range(0, t, chunk_size):
                yield i, i + 1, t0, min(t0 + chunk_size, t)
    else:
        rows = max(1, chunk_size // max(t, 1))
        for a0 in range(0, a, rows):
            yield a0, min(a0 + rows, a), 0, t


class _ChunkedFullKL(torch.autograd.Function):
    """KL(softmax(logits) || softmax(ref_logits)) per position on ``[A, T, V]`` inputs, in chunks.

    Saves only the inputs (which the caller holds anyway) and the ``[A, T]`` output; the backward
    pass recomputes each chunk's softmaxes, so extra memory is O(chunk_size x V) in both passes
    (plus the ``[A, T, V]`` gradient itself in the backward pass).
    Gradient: ``d KL / d logits_v = p_v * (log p_v - log q_v - KL)``.
    """

    @staticmethod
    def forward(ctx, logits, ref_logits, chunk_size, compute_dtype):
        a, t, _ = logits.shape
        out = torch.empty((a, t), dtype=compute_dtype, device=logits.device)
        for a0, a1, t0, t1 in _blocks(a, t, chunk_size):
            x = logits[a0:a1, t0:t1].to(compute_dtype)
            y = ref_logits[a0:a1, t0:t1].to(compute_dtype)
            out[a0:a1, t0:t1] = _full_kl_rows(x, y)[0]
        ctx.save_for_backward(logits, ref_logits, out)
        ctx.chunk_size = chunk_size
        ctx.compute_dtype = compute_dtype
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        logits, ref_logits, kl = ctx.saved_tensors
        grad = torch.empty_like(logits)
        a, t, _ = logits.shape
        for a0, a1, t0, t1 in _blocks(a, t, ctx.chunk_size):
            x = logits[a0:a1, t0:t1].to(ctx.compute_dtype)
            y = ref_logits[a0:a1, t0:t1].to(ctx.compute_dtype)
            _, p, logp, logq = _full_kl_rows(x, y)
            diff = logp - logq - kl[a0:a1, t0:t1, None]
            g = torch.where(p > 0, p * diff, torch.zeros((), dtype=p.dtype, device=p.device))
            grad[a0:a1, t0:t1] = (grad_out[a0:a1, t0:t1, None] * g).to(grad.dtype)
        return grad, None, None, None


def _as_3d(x: torch.Tensor, vocab: int, flat: bool) -> torch.Tensor:
    """A view ``[1, N, V]`` (``flat``) or ``[A, T, V]`` of ``[..., V]``, copying only if unavoidable."""
    if flat:
        return x.view(1, -1, vocab)
    if x.dim() == 3:
        return x
    try:
        return x.view(-1, x.shape[-2], vocab)
    except RuntimeError:
        return x.reshape(-1, x.shape[-2], vocab)  # rare: a copy


def _can_flatten(x: torch.Tensor, vocab: int) -> bool:
    try:
        x.view(1, -1, vocab)
        return True
    except RuntimeError:
        return False


def full_kl(logits: torch.Tensor, ref_logits: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """Exact per-position KL(pi_theta || pi_ref) over the whole vocabulary.

    ``sum_v softmax(logits)_v * (log_softmax(logits)_v - log_softmax(ref_logits)_v)``.

    Args:
        logits ``[..., V]``: policy logits (already divided by the sampling temperature); carries
            the gradient.
        ref_logits ``[..., V]``: reference logits, same shape and the same temperature; no gradient
            flows to them.
        chunk_size: positions processed at once. Extra memory is O(chunk_size x V) in the forward
            and backward passes: autograd keeps only the inputs and the ``[...]`` result, and the
            backward pass recomputes each chunk. Non-contiguous inputs such as ``logits[:, :-1]``
            are read through views, not copied.

    Returns:
        ``[...]``: KL per position; float32 for half-precision inputs, else the input dtype.

    Value: exact, so unbiased with zero variance per position. Gradient as a loss: the exact
    gradient of the per-position KL(pi_theta || pi_ref). Clamping: none needed (log_softmax is
    stable for any finite logits; vocabulary entries with pi_theta = 0 contribute 0).
    Source: old TRL ``kl_penalty="full"`` (which materialised every softmax at once).
    """
    if logits.shape != ref_logits.shape:
        raise ValueError(
            f"logits and ref_logits must have the same shape, got {tuple(logits.shape)} and {tuple(ref_logits.shape)}"
        )
    if logits.dim() == 0:
        raise ValueError("full_kl expects logits of shape [..., V]")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    vocab = logits.shape[-1]
    lead = logits.shape[:-1]
    compute_dtype = torch.promote_types(logits.dtype, torch.float32)
    ref_logits = ref_logits.detach()
    if logits.dim() == 1:
        logits, ref_logits = logits.unsqueeze(0), ref_logits.unsqueeze(0)
    flat = _can_flatten(logits, vocab) and _can_flatten(ref_logits, vocab)
    x = _as_3d(logits, vocab, flat)
    y = _as_3d(ref_logits, vocab, flat)
    out = _ChunkedFullKL.apply(x, y, chunk_size, compute_dtype)
    return out.reshape(lead)
