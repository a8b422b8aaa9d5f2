"""Token-weighted global statistics across data-parallel ranks.

Ranks usually hold different numbers of response tokens, so a mean of per-rank means (TRL PR 6380)
or an unweighted all-reduce of means (trlx, old TRL) is biased. These helpers reduce ``(sum, count)``
instead, packed into one float64 tensor so that every statistic costs ONE collective.

The collective is, in order of preference:
1. ``accelerator.reduce(t, reduction="sum")`` when an accelerator with ``num_processes > 1`` is
   given (anything with that attribute and method, e.g. ``accelerate.Accelerator``);
2. ``torch.distributed.all_reduce`` when a process group with world size > 1 is initialised;
3. nothing: single process.

Every rank must call these functions the same number of times in the same order (they are
collectives). Results are statistics, not losses: they carry no gradient.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "reduce_sum_count",
    "global_masked_mean",
    "global_sequence_sum_mean",
    "kl_statistic",
    "global_masked_whiten",
    "all_reduce_sum",
    "GlobalSums",
    "check_same_on_all_ranks",
    "KL_STATISTIC_UNITS",
]

KL_STATISTIC_UNITS = ("token", "sequence")


def all_reduce_sum(t: torch.Tensor, accelerator=None) -> torch.Tensor:
    """Sum ``t`` over all ranks (one collective; identity in a single process). Returns a new tensor."""
    if accelerator is not None:
        if getattr(accelerator, "num_processes", 1) > 1:
            return accelerator.reduce(t.clone(), reduction="sum")
        return t.clone()
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        out = t.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out
    return t.clone()


def _device_for(total, count, accelerator):
    """Where to put a packed tensor built from possibly Python numbers (NCCL needs CUDA tensors)."""
    for x in (total, count):
        if torch.is_tensor(x):
            return x.device
    if accelerator is not None:
        return getattr(accelerator, "device", None)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return None


def reduce_sum_count(total, count, accelerator=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Global ``(sum over ranks of total, sum over ranks of count)`` as float64 0-dim tensors.

    ``total``, ``count``: numbers or 0-dim tensors (this rank's contribution). One collective.
    """
    device = _device_for(total, count, accelerator)
    packed = torch.stack(
        [
            torch.as_tensor(total, dtype=torch.float64, device=device).detach().reshape(()),
            torch.as_tensor(count, dtype=torch.float64, device=device).detach().reshape(()),
        ]
    )
    packed = all_reduce_sum(packed, accelerator)
    return packed[0], packed[1]


def check_same_on_all_ranks(value: float, accelerator=None, what: str = "value") -> None:
    """Raise if ranks hold different `value`s (one small all-gather; nothing in a single process). State that
    every rank updates from the same global statistic, such as the KL coefficient, must stay identical."""
    if accelerator is None or getattr(accelerator, "num_processes", 1) == 1:
        return
    values = accelerator.gather(torch.tensor([float(value)], dtype=torch.float64, device=accelerator.device))
    if not torch.allclose(values, values[0], rtol=1e-12, atol=0.0):
        raise RuntimeError(
            f"{what} differs across ranks: {values.tolist()}. Every rank must update it from the same globally "
            "reduced statistic; this is a bug, please report it."
        )


class GlobalSums:
    """Collects ``(sum, count)`` pairs of named statistics and reduces all of them across ranks at once.

    ``add`` may be called any number of times per name (sums and counts accumulate); ``means`` costs one
    collective for every name together and returns ``{name: global sum / global count}`` (NaN for a zero
    count). Every rank must add the same names in the same order.
    """

    def __init__(self):
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, torch.Tensor] = {}

    def add(self, name: str, total, count) -> None:
        total = torch.as_tensor(total).detach().double().reshape(())
        count = torch.as_tensor(count, dtype=torch.float64, device=total.device).reshape(())
        if name in self.sums:
            self.sums[name] = self.sums[name] + total
            self.counts[name] = self.counts[name] + count
        else:
            self.sums[name], self.counts[name] = total, count

    def means(self, accelerator=None) -> dict[str, float]:
        if not self.sums:
            return {}
        names = list(self.sums)
        # statistics may come from the host (a float, the gradient norm) and from the accelerator: gather on one device
        device = _device_for(None, None, accelerator)  # the rank's own device, where there is one to ask
        if device is None:
            on_accelerator = [t.device for t in self.sums.values() if t.device.type != "cpu"]
            device = on_accelerator[0] if on_accelerator else "cpu"
        packed = torch.stack(
            [
                torch.stack([self.sums[n].to(device) for n in names]),
                torch.stack([self.counts[n].to(device) for n in names]),
            ]
        )
        totals, counts = all_reduce_sum(packed, accelerator).tolist()
        return {n: t / c if c > 0 else float("nan") for n, t, c in zip(names, totals, counts)}


def _masked(values: torch.Tensor, mask: torch.Tensor):
    """values as float64 with zeros outside the mask, and the float64 mask. Shapes: ``[B, T]``."""
    if values.shape != mask.shape:
        raise ValueError(f"values and mask must have the same shape, got {tuple(values.shape)} and {tuple(mask.shape)}")
    keep = mask.bool()
    v = values.detach().to(torch.float64)
    return torch.where(keep, v, torch.zeros((), dtype=torch.float64, device=v.device)), keep.to(torch.float64)


def explained_variance(returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, accelerator=None) -> float:
    """``1 - Var(returns - values) / Var(returns)`` over every masked token of every rank (``[B, T]`` each): 1 when
    the values predict the returns exactly, 0 when they do no better than the returns' mean, below 0 when worse;
    NaN when the returns do not vary. One collective."""
    r, keep = _masked(returns, mask)
    e = r - _masked(values, mask)[0]
    n, sr, srr, se, see = all_reduce_sum(
        torch.stack([keep.sum(), r.sum(), (r * r).sum(), e.sum(), (e * e).sum()]), accelerator
    ).tolist()
    if n <= 0:
        return float("nan")
    var_returns = srr / n - (sr / n) ** 2
    var_error = see / n - (se / n) ** 2
    return 1.0 - var_error / var_returns if var_returns > 1e-12 else float("nan")


def global_masked_mean(values: torch.Tensor, mask: torch.Tensor, accelerator=None) -> torch.Tensor:
    """Mean of ``values`` over every masked token of every rank. ``[B, T] -> []`` (float64).

    ``sum_ranks sum(v * m) / sum_ranks sum(m)``; 0 when no rank has a token.
    """
    v, m = _masked(values, mask)
    total, count = reduce_sum_count(v.sum(), m.sum(), accelerator)
    return total / count.clamp(min=1)


def global_sequence_sum_mean(values: torch.Tensor, mask: torch.Tensor, accelerator=None) -> torch.Tensor:
    """Mean over every sequence of every rank of the per-sequence masked sum. ``[B, T] -> []`` (float64).

    ``sum_ranks sum_b sum_t v*m / sum_ranks B``: the KL unit of trlx and old TRL (nats per sequence).
    Rows without tokens count as sequences with sum 0.
    """
    v, _ = _masked(values, mask)
    n_seqs = math.prod(v.shape[:-1]) if v.dim() > 0 else 1
    total, count = reduce_sum_count(v.sum(), float(n_seqs), accelerator)
    return total / count.clamp(min=1)


def unit_count(mask: torch.Tensor, unit: str) -> torch.Tensor:
    """How many units a statistic in `unit` averages over on this rank: the rows of `mask` (`"sequence"`) or its
    tokens (`"token"`), a float64 tensor on `mask`'s device (no host sync)."""
    if unit == "sequence":
        return torch.full((), float(mask.shape[0]), dtype=torch.float64, device=mask.device)
    return mask.sum(dtype=torch.float64)


def kl_statistic(kl: torch.Tensor, mask: torch.Tensor, unit: str = "token", accelerator=None) -> torch.Tensor:
    """The controller's KL statistic, ``[B, T] -> []`` (float64).

    unit="token": token-weighted global mean (nats per token, verl's convention);
    unit="sequence": global mean of per-sequence sums (nats per sequence, trlx / old TRL).
    """
    if unit == "token":
        return global_masked_mean(kl, mask, accelerator)
    if unit == "sequence":
        return global_sequence_sum_mean(kl, mask, accelerator)
    raise ValueError(f"Unknown KL statistic unit {unit!r}; choose one of {', '.join(KL_STATISTIC_UNITS)}")


def global_masked_whiten(
    values: torch.Tensor,
    mask: torch.Tensor,
    accelerator=None,
    shift_mean: bool = True,
    eps: float = 1e-8,
    return_std: bool = False,
):
    """Whiten with the mean and unbiased variance of the masked tokens of ALL ranks. ``[B, T] -> [B, T]``.

    ``(v - mean) / sqrt(var + eps)`` (plus ``mean`` again if not ``shift_mean``, as in verl /
    TRL), zero outside the mask, in ``values``' dtype. One collective of (sum, sum of squares,
    count), accumulated in float64. With fewer than two tokens in total the variance is taken as 0.
    The statistics are constants: a gradient through ``values`` (if any) sees only the affine map.
    With ``return_std``, returns ``(whitened, std)`` where ``std = sqrt(var + eps)`` is the 0-dim float64
    divisor that was used (identical on every rank).
    """
    v, m = _masked(values, mask)
    packed = all_reduce_sum(torch.stack([v.sum(), v.square().sum(), m.sum()]), accelerator)
    total, total_sq, count = packed[0], packed[1], packed[2]
    n = count.clamp(min=1)
    mean = total / n
    biased_var = (total_sq / n - mean.square()).clamp(min=0)
    var = torch.where(count > 1, biased_var * count / (count - 1).clamp(min=1), torch.zeros_like(biased_var))
    mean_t = mean.to(values.dtype)
    whitened = (values - mean_t) * torch.rsqrt(var + eps).to(values.dtype)
    if not shift_mean:
        whitened = whitened + mean_t
    whitened = torch.where(mask.bool(), whitened, torch.zeros((), dtype=values.dtype, device=values.device))
    return (whitened, torch.sqrt(var + eps)) if return_std else whitened
