"""KL rewards, KL loss, and loss aggregation (incl. global counts across simulated ranks)."""

import pytest
import torch

from klppo.kl import LOSS_AGG_MODES, aggregate_loss, compute_kl, kl_loss, kl_reward

F64 = torch.float64


def _batch(seed=0, b=4, t=6):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(b, t, generator=gen, dtype=F64)
    lengths = [6, 2, 4, 1][:b]
    mask = torch.zeros(b, t, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    return values, mask


def _hand(values, mask, mode, num_tokens=None, num_seqs=None, norm_len=None):
    """Naive loops, one per mode."""
    b, t = values.shape
    rows = [[values[i, j].item() for j in range(t) if mask[i, j]] for i in range(b)]
    n_tok = sum(len(r) for r in rows) if num_tokens is None else num_tokens
    n_seq = b if num_seqs is None else num_seqs
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / max(n_tok, 1)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in rows) / n_seq
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / max(len(r), 1) for r in rows) / n_seq
    return sum(sum(r) for r in rows) / (n_seq * norm_len)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_modes_match_hand_loops(mode):
    values, mask = _batch()
    norm = dict(norm_len=7)  # the constant of seq-mean-token-sum-norm (the maximum response length), not T
    assert aggregate_loss(values, mask, mode, **norm).item() == pytest.approx(
        _hand(values, mask, mode, **norm), rel=1e-12
    )
    kwargs = dict(num_tokens=40, num_seqs=9, norm_len=11)
    assert aggregate_loss(values, mask, mode, **kwargs).item() == pytest.approx(
        _hand(values, mask, mode, **kwargs), rel=1e-12
    )
    # the modes really differ on this batch
    others = {m: aggregate_loss(values, mask, m, **norm).item() for m in LOSS_AGG_MODES}
    assert len({round(v, 9) for v in others.values()}) == len(LOSS_AGG_MODES)


def test_seq_mean_token_sum_norm_needs_its_constant():
    """The padded width T changes with each batch's longest response: the normaliser must be given."""
    values, mask = _batch()
    with pytest.raises(ValueError, match="norm_len"):
        aggregate_loss(values, mask, "seq-mean-token-sum-norm")
    # padding the batch with masked columns changes nothing
    wide_values = torch.nn.functional.pad(values, (0, 5), value=float("nan"))
    wide_mask = torch.nn.functional.pad(mask, (0, 5), value=False)
    assert aggregate_loss(wide_values, wide_mask, "seq-mean-token-sum-norm", norm_len=7).item() == pytest.approx(
        aggregate_loss(values, mask, "seq-mean-token-sum-norm", norm_len=7).item(), rel=1e-15
    )


def test_masked_positions_are_ignored_even_if_not_finite():
    values, mask = _batch()
    poisoned = values.clone()
    poisoned[~mask] = float("nan")
    poisoned = poisoned.requires_grad_()
    for mode in LOSS_AGG_MODES:
        loss = aggregate_loss(poisoned, mask, mode, norm_len=6)
        assert loss.item() == pytest.approx(aggregate_loss(values, mask, mode, norm_len=6).item())
        (g,) = torch.autograd.grad(loss, poisoned)
        assert torch.isfinite(g).all() and (g[~mask] == 0).all()


def test_empty_mask_gives_zero_not_nan():
    values = torch.randn(3, 4, dtype=F64, requires_grad=True)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    for mode in LOSS_AGG_MODES:
        loss = aggregate_loss(values, mask, mode, norm_len=4)
        assert loss.item() == 0.0
        (g,) = torch.autograd.grad(loss, values)
        assert torch.isfinite(g).all()
    assert aggregate_loss(values, mask, "token-mean", num_tokens=0).item() == 0.0


def test_validation():
    values, mask = _batch()
    with pytest.raises(ValueError) as err:
        aggregate_loss(values, mask, "mean")
    for mode in LOSS_AGG_MODES:
        assert mode in str(err.value)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        aggregate_loss(values[0], mask[0])


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_global_counts_make_rank_losses_sum_to_the_global_loss(mode):
    """Two 'ranks' with different token counts: with global counts, sum of rank losses == global loss
    (which is what DDP's average times the world size gives); per-rank means averaged do not."""
    values, mask = _batch()
    global_loss = aggregate_loss(values, mask, mode, norm_len=values.shape[1])
    ranks = [(values[:1], mask[:1]), (values[1:], mask[1:])]  # 6 tokens vs 7 tokens, 1 vs 3 sequences
    counts = dict(num_tokens=mask.sum(), num_seqs=values.shape[0], norm_len=values.shape[1])
    summed = sum(aggregate_loss(v, m, mode, **counts) for v, m in ranks)
    assert summed.item() == pytest.approx(global_loss.item(), rel=1e-12)
    # gradients too: the summed per-rank losses give the global gradient
    leaf = values.clone().requires_grad_()
    (g_global,) = torch.autograd.grad(aggregate_loss(leaf, mask, mode, norm_len=values.shape[1]), leaf)
    (g_ranks,) = torch.autograd.grad(
        sum(aggregate_loss(leaf[s], mask[s], mode, **counts) for s in (slice(0, 1), slice(1, 4))), leaf
    )
    assert torch.allclose(g_global, g_ranks)
    # the naive alternative: every rank normalises locally, DDP averages
    mean_of_means = sum(aggregate_loss(v, m, mode, norm_len=values.shape[1]) for v, m in ranks) / 2
    assert mean_of_means.item() != pytest.approx(global_loss.item(), rel=1e-6)


def test_kl_reward():
    logp = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -0.2, -4.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-1.2, -0.5, -1.0], [-0.1, -0.9, -4.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    kl = compute_kl(logp, ref, "k1")
    r = kl_reward(kl, mask, 0.1)
    expected = -0.1 * (logp - ref).detach() * mask
    assert torch.allclose(r, expected) and not r.requires_grad
    assert (r[0, 2] == 0).all()
    r_t = kl_reward(kl, mask.bool(), torch.tensor(0.1, dtype=F64, requires_grad=True))
    assert torch.allclose(r_t, expected) and not r_t.requires_grad
    poisoned = kl.detach().clone()
    poisoned[0, 2] = float("inf")
    assert kl_reward(poisoned, mask, 0.1)[0, 2] == 0


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_kl_loss_is_coef_times_aggregate(mode):
    values, mask = _batch()
    logp = values.clone().requires_grad_()
    ref = torch.zeros_like(values)
    kl = compute_kl(logp, ref, "k2")
    counts = dict(num_tokens=50, num_seqs=7, norm_len=6)
    loss = kl_loss(kl, mask, 0.3, mode, **counts)
    assert loss.item() == pytest.approx(0.3 * aggregate_loss(kl, mask, mode, **counts).item())
    (g,) = torch.autograd.grad(loss, logp)
    assert (g[~mask] == 0).all() and g[mask].abs().sum() > 0
