"""Per-token KL estimators, their registry, and the exact full-vocabulary KL.

Notation, per sampled response token (`docs/kl.md`, "KL estimators and the gradient each one gives")::

    d = logp - ref_logp          log pi_theta(token) - log pi_ref(token)
    r = exp(-d)                  pi_ref(token) / pi_theta(token)
    s = grad log pi_theta(token) the score

"Value unbiased" means ``E_{token ~ pi_theta}[k] = KL(pi_theta || pi_ref)``. The gradient an
estimator gives depends on how it is used: backpropagated through ("loss mode") or detached into the
return ("reward mode"); ``klppo.kl.divergence.divergence_followed`` answers that question for every
estimator and mode, and each docstring below states the loss-mode answer.

Every per-token estimator is a function of the log-ratios alone, and every registered one shares one signature::

    fn(log_ratio, old_log_ratio=None, log_ratio_clamp=40.0) -> Tensor

- ``log_ratio`` ``[...]``: ``d = logp - ref_logp`` of the sampled token, with the reference detached; in the loss
  it carries the policy's gradient.
- ``old_log_ratio`` ``[...]`` or ``None``: ``logp - old_logp``, the same token's log-ratio to the policy that
  sampled the rollout (0 at that policy); read by ``corrected_k3`` only.
- ``log_ratio_clamp``: ``C``; both log-ratios are clamped to ``[-C, C]`` before any ``exp``. ``C = 40`` keeps
  float32 finite (exp(40) ~ 2.35e17) and therefore also every gradient: a clamp on the output alone would still
  give ``0 * inf = NaN`` gradients. ``torch.clamp`` passes no gradient outside its range, so a clamped token gets a
  zero gradient from the log-ratio. ``None`` disables the clamp (then a large ``|d|`` can overflow).

The output has the broadcast shape of the inputs and their dtype. ``kl_from_log_ratio`` is the entry point that also
applies the optional output clamp and reports which tokens hit a clamp; ``compute_kl`` takes log-probs instead and
forms the log-ratios first. A rollout's log-ratio is formed once and every estimate of it reads that one tensor.

Estimators that need the whole distribution rather than the sampled token's log-probs (the exact
``full`` KL) register with ``inputs="logits"`` and the signature ``fn(logits, ref_logits, chunk_size)``;
``estimate_kl`` calls either kind with what it needs.

Adding an estimator is one function and one decorator line::

    @register_kl_estimator("my_kl", formula="...")
    def kl_my(log_ratio, old_log_ratio=None, log_ratio_clamp=40.0): ...

The decorator also registers the straight-through twin ``my_kl+`` (value of ``my_kl``, gradient
of ``k2``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.autograd.function import once_differentiable

__all__ = [
    "KLEstimatorSpec",
    "register_kl_estimator",
    "get_kl_estimator",
    "get_kl_estimator_spec",
    "kl_estimators",
    "compute_kl",
    "kl_from_log_ratio",
    "estimate_kl",
    "full_kl",
    "BUILTIN_KL_ESTIMATORS",
    "unregister_kl_estimator",
    "LOW_VAR_KL_CLAMP",
]

KLEstimatorFn = Callable[..., torch.Tensor]

# verl's `low_var_kl` clamps its output to [-10, 10].
LOW_VAR_KL_CLAMP = 10.0


@dataclass(frozen=True)
class KLEstimatorSpec:
    """One registry entry.

    name: registry key. fn: the estimator. formula: value formula, for docs and the estimator table.
    uses_old_logp: whether ``old_logp`` changes the result. output_clamp: a bound the estimator
    itself applies to its output (``low_var_kl``), or None. base: for a straight-through ``X+``
    entry the name ``X``, otherwise the entry's own name. inputs: ``"logprobs"`` (the sampled
    tokens' log-probs, the shared signature) or ``"logits"`` (``fn(logits, ref_logits, chunk_size)``).
    """

    name: str
    fn: KLEstimatorFn
    formula: str
    uses_old_logp: bool = False
    output_clamp: Optional[float] = None
    base: str = ""
    inputs: str = "logprobs"

    @property
    def straight_through(self) -> bool:
        return self.base != self.name

    @property
    def needs_logits(self) -> bool:
        return self.inputs == "logits"


_KL_ESTIMATORS: dict[str, KLEstimatorSpec] = {}


def register_kl_estimator(
    name: str,
    formula: str,
    *,
    uses_old_logp: bool = False,
    output_clamp: Optional[float] = None,
    straight_through: bool = True,
    inputs: str = "logprobs",
):
    """Decorator: register ``fn`` under ``name`` (and, by default, its twin ``name + "+"``).

    The twin has the value of ``fn`` and the gradient of ``k2``:
    ``k2 - k2.detach() + fn(...).detach()``. ``inputs="logits"`` registers an estimator of the whole
    distribution (no twin: it has no sampled token to take a ``k2`` gradient at).
    """
    if inputs not in ("logprobs", "logits"):
        raise ValueError(f"inputs must be 'logprobs' or 'logits', got {inputs!r}")
    straight_through = straight_through and inputs == "logprobs"

    def decorator(fn: KLEstimatorFn) -> KLEstimatorFn:
        names = [name, name + "+"] if straight_through else [name]
        for key in names:
            if key in _KL_ESTIMATORS:
                raise ValueError(f"KL estimator {key!r} is already registered")
        _KL_ESTIMATORS[name] = KLEstimatorSpec(name, fn, formula, uses_old_logp, output_clamp, name, inputs)
        if straight_through:
            twin = _make_straight_through(fn, name)
            _KL_ESTIMATORS[name + "+"] = KLEstimatorSpec(
                name + "+", twin, f"value of {name}, gradient of k2", uses_old_logp, output_clamp, name
            )
        return fn

    return decorator


def unregister_kl_estimator(name: str) -> None:
    """Remove a registered estimator and its ``X+`` twin (for tests and plug-ins); ``KeyError`` if unknown."""
    spec = _KL_ESTIMATORS.pop(name)
    if not spec.straight_through:
        _KL_ESTIMATORS.pop(name + "+", None)


def _unknown_estimator_error(name) -> ValueError:
    valid = ", ".join(repr(n) for n in kl_estimators())
    return ValueError(
        f"Unknown KL estimator {name!r}. Valid estimators: {valid}. Register a new one with "
        "`klppo.kl.register_kl_estimator`."
    )


def get_kl_estimator_spec(name: str) -> KLEstimatorSpec:
    """The registry entry for ``name``; ``ValueError`` listing the valid names if unknown."""
    try:
        return _KL_ESTIMATORS[name]
    except (KeyError, TypeError):
        raise _unknown_estimator_error(name) from None


def get_kl_estimator(name: str) -> KLEstimatorFn:
    """The estimator function registered under ``name`` (shared signature in the module docstring)."""
    return get_kl_estimator_spec(name).fn


def kl_estimators(inputs: Optional[str] = None) -> list[str]:
    """Registered names: per-token estimators in registration order, their ``X+`` twins, then the
    logits-based ones. ``inputs="logprobs"`` or ``"logits"`` lists one kind only."""
    specs = [s for s in _KL_ESTIMATORS.values() if inputs is None or s.inputs == inputs]
    per_token = [s for s in specs if not s.needs_logits]
    return (
        [s.name for s in per_token if not s.straight_through]
        + [s.name for s in per_token if s.straight_through]
        + [s.name for s in specs if s.needs_logits]
    )


# ---------------------------------------------------------------------------------------------
# helpers


def _clamp(x: torch.Tensor, bound: Optional[float]) -> torch.Tensor:
    return x if bound is None else x.clamp(-bound, bound)


def _k2(d, log_ratio_clamp):
    return 0.5 * _clamp(d, log_ratio_clamp).square()


def _k3(d, log_ratio_clamp):
    d = _clamp(d, log_ratio_clamp)
    # r - 1 - log r with r = exp(-d); expm1 keeps precision for small |d|.
    return torch.expm1(-d) + d


def _make_straight_through(fn: KLEstimatorFn, name: str) -> KLEstimatorFn:
    def straight_through(log_ratio, old_log_ratio=None, log_ratio_clamp=40.0):
        value = fn(log_ratio, old_log_ratio, log_ratio_clamp)
        k2 = _k2(log_ratio, log_ratio_clamp)
        # Forward: exactly `value`. Backward: exactly the gradient of k2.
        return k2 - k2.detach() + value.detach()

    straight_through.__name__ = f"kl_{name}_plus".replace("+", "")
    straight_through.__qualname__ = straight_through.__name__
    straight_through.__doc__ = f"""Straight-through ``{name}+``: value of ``{name}``, gradient of ``k2``.

    Formula: ``k2 - k2.detach() + {name}.detach()``.
    Value: that of ``{name}``. Gradient (loss mode): ``d * s``, whose on-policy expectation is
    grad KL(pi_theta || pi_ref) (unbiased per token); off-policy it needs an importance weight,
    which this twin does not apply. Clamping: as ``{name}`` for the value, ``d`` clamped for the
    gradient. Source: verl's "+" estimators (fixed in verl PR 6058).
    """
    return straight_through


# ---------------------------------------------------------------------------------------------
# the estimators


@register_kl_estimator("k1", formula="d")
def kl_k1(log_ratio, old_log_ratio=None, log_ratio_clamp=40.0):
    """k1 = d = logp - ref_logp.  Shapes: ``[...] -> [...]``.

    Value: unbiased for KL(pi_theta || pi_ref), high variance, can be negative.
    Gradient as a loss: ``s``, expectation 0 (no regularisation, only noise). In the reward (with
    reward-to-go) it gives the unbiased gradient of the sequence-level KL(pi_theta || pi_ref).
    Clamping: ``d`` to ``[-C, C]``. Source: Schulman 2020 ("Approximating KL Divergence");
    Ziegler et al. 2019 use it in the reward.
    """
    return _clamp(log_ratio, log_ratio_clamp)


@register_kl_estimator("k2", formula="d^2 / 2")
def kl_k2(log_ratio, old_log_ratio=None, log_ratio_clamp=40.0):
    """k2 = d**2 / 2.  Shapes: ``[...] -> [...]``.

    Value: biased (an f-divergence that matches KL to second order), always >= 0.
    Gradient as a loss: ``d * s``, whose on-policy expectation is grad KL(pi_theta || pi_ref)
    (unbiased per token; k2 as loss == k1 in the reward, token-wise). Off-policy without an
    importance weight it follows neither KL direction.
    Clamping: ``d`` to ``[-C, C]``. Source: Schulman 2020; verl calls it ``mse``; OpenRLHF.
    """
    return _k2(log_ratio, log_ratio_clamp)


@register_kl_estimator("k3", formula="exp(-d) - 1 + d")
def kl_k3(log_ratio, old_log_ratio=None, log_ratio_clamp=40.0):
    """k3 = r - 1 - log r = expm1(-d) + d.  Shapes: ``[...] -> [...]``.

    Value: unbiased for KL(pi_theta || pi_ref), low variance, always >= 0.
    Gradient as a loss: ``(1 - r) * s``, whose on-policy expectation is grad KL(pi_ref || pi_theta):
    the FORWARD KL, not the reverse KL that the value estimates. In the reward it gives
    grad KL(pi||ref) - grad KL(ref||pi).
    Clamping: ``d`` to ``[-C, C]`` before the exp. Source: Schulman 2020; the GRPO loss.
    """
    return _k3(log_ratio, log_ratio_clamp)


@register_kl_estimator("low_var_kl", formula="clamp(k3, -10, 10)", output_clamp=LOW_VAR_KL_CLAMP)
def kl_low_var_kl(log_ratio, old_log_ratio=None, log_ratio_clamp=40.0):
    """low_var_kl = clamp(k3, -10, 10).  Shapes: ``[...] -> [...]``.

    Value: k3 with the output clamped, so biased (downwards) where k3 > 10.
    Gradient as a loss: that of k3 (grad KL(pi_ref || pi_theta)) except that the output clamp
    zeroes the gradient of the most divergent tokens: ``d < -2.611`` (``log(ref/pi) > 2.611``) or
    ``d > 11.0``.
    Clamping: ``d`` to ``[-C, C]``, then the output to ``[-10, 10]``. Source: verl ``low_var_kl``.
    """
    return _k3(log_ratio, log_ratio_clamp).clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)


@register_kl_estimator("abs", formula="abs(d)")
def kl_abs(log_ratio, old_log_ratio=None, log_ratio_clamp=40.0):
    """abs = |d|.  Shapes: ``[...] -> [...]``.

    Value: biased (E|d| >= KL), >= 0.
    Gradient as a loss: ``sign(d) * s``, whose on-policy expectation is the gradient of
    ``sum_x |pi_theta(x) - pi_ref(x)|`` (twice the total-variation distance), not of a KL.
    Clamping: ``d`` to ``[-C, C]``. Source: verl ``abs``; old TRL ``kl_penalty="abs"``.
    """
    return _clamp(log_ratio, log_ratio_clamp).abs()


@register_kl_estimator("corrected_k3", formula="w * k3, w = pi / pi_old", uses_old_logp=True)
def kl_corrected_k3(log_ratio, old_log_ratio=None, log_ratio_clamp=40.0):
    """corrected_k3 = w * k3 with w = exp(clamp(logp - old_logp)) = pi_theta / pi_old.

    Shapes: ``[...] -> [...]``. The gradient flows through both ``w`` and ``k3``:
    ``grad(w * k3) = w * (k3 + 1 - r) * s = w * d * s``, so under tokens sampled from pi_old the
    expected gradient is grad KL(pi_theta || pi_ref), on- and off-policy (DeepSeek-V3.2 Eq. 7).
    Value: ``w * k3`` is an unbiased importance-weighted estimate of KL(pi_theta || pi_ref) under
    pi_old sampling; at theta = old it equals k3. Without ``old_log_ratio`` it is plain k3.
    Clamping: both log-ratios to ``[-C, C]`` before their exp. Source: DeepSeek-V3.2 Eq. 7;
    Trinity; TRL GRPO ``use_bias_correction_kl``.
    """
    k3 = _k3(log_ratio, log_ratio_clamp)
    if old_log_ratio is None:
        return k3
    return torch.exp(_clamp(old_log_ratio, log_ratio_clamp)) * k3




# ---------------------------------------------------------------------------------------------
# entry point


def _check_bound(value, name):
    if value is None:
        return None
    value = float(value)
    if not value > 0:
        raise ValueError(f"{name} must be a positive number or None to disable it, got {value}")
    return value


def kl_from_log_ratio(
    log_ratio: torch.Tensor,
    estimator: str = "k1",
    old_log_ratio: Optional[torch.Tensor] = None,
    log_ratio_clamp: Optional[float] = 40.0,
    value_clamp: Optional[float] = None,
    return_clamped: bool = False,
):
    """Per-token KL estimate from the log-ratios, differentiable through them.

    Args:
        log_ratio ``[...]``: ``d = logp - ref_logp`` of the sampled tokens (the policy's gradient, if any, flows
            through it).
        estimator: a per-token name from ``kl_estimators()``.
        old_log_ratio ``[...]`` or None: ``logp - old_logp``; read by ``corrected_k3`` (and its twin) only. At the
            policy that sampled the tokens it is 0 (the same as None).
        log_ratio_clamp: clamp both log-ratios to ``[-C, C]`` before any exp; None disables it.
        value_clamp: opt-in clamp of the output to ``[-value_clamp, value_clamp]`` (10 reproduces
            OpenRLHF's ``compute_approx_kl``); clamped tokens get a zero gradient.
        return_clamped: also return a bool mask of the tokens where any clamp was active (log-ratio,
            importance ratio, the estimator's own output clamp, ``value_clamp``); its mean is the
            ``kl/clamped_frac`` metric.

    Returns:
        ``kl`` ``[...]`` (broadcast shape, input dtype), or ``(kl, clamped)`` with ``clamped`` a bool
        tensor of the same shape.
    """
    spec = get_kl_estimator_spec(estimator)
    if spec.needs_logits:
        raise ValueError(
            f"KL estimator {estimator!r} takes logits, not log-probs: call `estimate_kl` with logits and "
            "ref_logits (or `full_kl(logits, ref_logits)`)."
        )
    log_ratio_clamp = _check_bound(log_ratio_clamp, "log_ratio_clamp")
    value_clamp = _check_bound(value_clamp, "value_clamp")
    kl = spec.fn(log_ratio, old_log_ratio, log_ratio_clamp)

    clamped = None
    if return_clamped:
        with torch.no_grad():
            clamped = torch.zeros(kl.shape, dtype=torch.bool, device=kl.device)
            if log_ratio_clamp is not None:
                clamped |= log_ratio.abs() > log_ratio_clamp
                if spec.uses_old_logp and old_log_ratio is not None:
                    clamped |= old_log_ratio.abs() > log_ratio_clamp
            if spec.output_clamp is not None:
                clamped |= kl.abs() >= spec.output_clamp
            if value_clamp is not None:
                clamped |= kl.abs() > value_clamp
    if value_clamp is not None:
        kl = kl.clamp(-value_clamp, value_clamp)
    return (kl, clamped) if return_clamped else kl


def compute_kl(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    estimator: str = "k1",
    old_logp: Optional[torch.Tensor] = None,
    log_ratio_clamp: Optional[float] = 40.0,
    value_clamp: Optional[float] = None,
    return_clamped: bool = False,
):
    """``kl_from_log_ratio`` from log-probs: ``logp`` ``[...]`` (log pi_theta of the sampled tokens, carries the
    gradient), ``ref_logp`` and ``old_logp`` (log pi_ref and log pi_old of the same tokens, constants; ``old_logp``
    is read by ``corrected_k3`` only). The other arguments and the result are ``kl_from_log_ratio``'s."""
    old_log_ratio = None if old_logp is None else logp - old_logp.detach()
    return kl_from_log_ratio(logp - ref_logp.detach(), estimator, old_log_ratio, log_ratio_clamp=log_ratio_clamp,
                             value_clamp=value_clamp, return_clamped=return_clamped)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# full-vocabulary KL


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
            f"logits and ref_logits must have the same shape, got {tuple(logits.shape)} "
            f"and {tuple(ref_logits.shape)}"
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


@register_kl_estimator("full", formula="sum_v pi_v * (log pi_v - log ref_v)", inputs="logits")
def kl_full(logits, ref_logits, chunk_size=1024):
    """Exact per-position KL(pi || ref) over the vocabulary (``full_kl``)."""
    return full_kl(logits, ref_logits, chunk_size=chunk_size)


# the estimators klppo ships (anything registered later is a plug-in)
BUILTIN_KL_ESTIMATORS: tuple[str, ...] = tuple(kl_estimators())


def estimate_kl(
    estimator: str,
    logp: Optional[torch.Tensor] = None,
    ref_logp: Optional[torch.Tensor] = None,
    old_logp: Optional[torch.Tensor] = None,
    logits: Optional[torch.Tensor] = None,
    ref_logits: Optional[torch.Tensor] = None,
    chunk_size: int = 1024,
    return_clamped: bool = False,
    log_ratio: Optional[torch.Tensor] = None,
    old_log_ratio: Optional[torch.Tensor] = None,
    **clamps,
):
    """Per-position KL by any registered estimator. A per-token one reads ``log_ratio`` (and ``old_log_ratio``)
    when given, else forms them from ``logp``, ``ref_logp`` and ``old_logp`` (``kl_from_log_ratio``, with
    ``clamps``: ``log_ratio_clamp``, ``value_clamp``); a logits-based one reads ``logits`` / ``ref_logits``
    (temperature-scaled, ``[..., V]``) and its values are never clamped."""
    spec = get_kl_estimator_spec(estimator)
    if not spec.needs_logits:
        if log_ratio is None:
            return compute_kl(logp, ref_logp, estimator, old_logp=old_logp, return_clamped=return_clamped, **clamps)
        return kl_from_log_ratio(log_ratio, estimator, old_log_ratio, return_clamped=return_clamped, **clamps)
    if logits is None or ref_logits is None:
        raise ValueError(f"KL estimator {estimator!r} needs the policy's and the reference's logits.")
    kl = spec.fn(logits, ref_logits.detach(), chunk_size)
    return (kl, torch.zeros(kl.shape, dtype=torch.bool, device=kl.device)) if return_clamped else kl
