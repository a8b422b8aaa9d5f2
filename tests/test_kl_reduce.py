"""Token-weighted global statistics: simulated ranks in threads, and a real two-process run."""

import json
import math
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from klppo.kl import (
    global_masked_mean,
    global_masked_whiten,
    global_sequence_sum_mean,
    kl_statistic,
    reduce_sum_count,
)

F64 = torch.float64
ROOT = Path(__file__).resolve().parents[1]


class _Group:
    """State shared by the simulated ranks of one run."""

    def __init__(self, world):
        self.world = world
        self.barrier = threading.Barrier(world)
        self.slots = [None] * world
        self.calls = [0] * world


class ThreadAccelerator:
    """Stands in for accelerate.Accelerator on one simulated rank: ``reduce`` is a real
    barrier-synchronised sum over the ranks (threads) of the group."""

    def __init__(self, group, rank):
        self.group, self.process_index = group, rank
        self.num_processes = group.world
        self.device = torch.device("cpu")

    def reduce(self, tensor, reduction="sum"):
        assert reduction == "sum"
        g = self.group
        g.calls[self.process_index] += 1
        g.slots[self.process_index] = tensor.clone()
        g.barrier.wait()
        out = torch.stack(g.slots).sum(0)
        g.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return out


def run_ranks(fn, shards):
    """Run ``fn(*shard, accelerator)`` for every shard in its own thread; results in rank order."""
    group = _Group(len(shards))
    results, errors = [None] * len(shards), []

    def target(rank):
        try:
            results[rank] = fn(*shards[rank], ThreadAccelerator(group, rank))
        except BaseException as exc:  # surface failures from the thread
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=target, args=(r,)) for r in range(len(shards))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return results, group.calls


def _batch():
    """values/mask [5, 7]; ranks: rows 0-1 (10 tokens) and rows 2-4 (12 tokens)."""
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(5, 7, generator=gen, dtype=F64) * 0.3 + 0.1
    mask = torch.zeros(5, 7, dtype=torch.bool)
    for row, n in enumerate([7, 3, 5, 1, 6]):
        mask[row, :n] = True
    return values, mask


def _shards(values, mask):
    return [(values[:2], mask[:2]), (values[2:], mask[2:])]


def test_single_process_is_identity():
    values, mask = _batch()
    total, count = reduce_sum_count(torch.tensor(3.5), 7)
    assert total.dtype == F64 and count.dtype == F64 and (total.item(), count.item()) == (3.5, 7.0)
    assert global_masked_mean(values, mask).item() == pytest.approx(values[mask].mean().item(), rel=1e-14)
    assert global_sequence_sum_mean(values, mask).item() == pytest.approx(
        (values * mask).sum(1).mean().item(), rel=1e-14
    )

    class OneProcess:
        num_processes = 1

        def reduce(self, *a, **k):
            raise AssertionError("a single process must not communicate")

    assert global_masked_mean(values, mask, OneProcess()).item() == pytest.approx(values[mask].mean().item())


def test_token_mean_across_ranks_is_global_and_unbiased():
    values, mask = _batch()
    results, calls = run_ranks(global_masked_mean, _shards(values, mask))
    global_mean = values[mask].mean()
    for r in results:
        assert r.dtype == F64 and r.shape == ()
        assert r.item() == pytest.approx(global_mean.item(), rel=1e-14)
    assert calls == [1, 1]  # (sum, count) travel in one collective
    # the mean of per-rank means is biased when ranks hold different token counts
    mean_of_means = sum(v[m].mean() for v, m in _shards(values, mask)) / 2
    assert abs(mean_of_means.item() - global_mean.item()) > 1e-3


def test_sequence_sum_mean_across_ranks():
    values, mask = _batch()
    results, calls = run_ranks(global_sequence_sum_mean, _shards(values, mask))
    expected = (values * mask).sum(1).mean()
    assert all(r.item() == pytest.approx(expected.item(), rel=1e-14) for r in results)
    assert calls == [1, 1]
    mean_of_means = sum((v * m).sum(1).mean() for v, m in _shards(values, mask)) / 2
    assert abs(mean_of_means.item() - expected.item()) > 1e-3


def test_kl_statistic_dispatch():
    values, mask = _batch()
    assert torch.equal(kl_statistic(values, mask, "token"), global_masked_mean(values, mask))
    assert torch.equal(kl_statistic(values, mask, "sequence"), global_sequence_sum_mean(values, mask))
    with pytest.raises(ValueError, match="token, sequence"):
        kl_statistic(values, mask, "batch")


def _reference_whiten(values, mask, shift_mean=True, eps=1e-8):
    sel = values[mask]
    mean, var = sel.mean(), sel.var(unbiased=True)
    out = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask, out, torch.zeros((), dtype=values.dtype))


@pytest.mark.parametrize("shift_mean", [True, False])
def test_whiten_across_ranks_matches_global(shift_mean):
    values, mask = _batch()
    expected = _reference_whiten(values, mask, shift_mean)
    assert torch.allclose(global_masked_whiten(values, mask, shift_mean=shift_mean), expected, atol=1e-12)
    results, calls = run_ranks(
        lambda v, m, acc: global_masked_whiten(v, m, acc, shift_mean=shift_mean), _shards(values, mask)
    )
    assert torch.allclose(torch.cat(results), expected, atol=1e-12)
    assert calls == [1, 1]
    # whitening each rank on its own statistics gives something else
    local = torch.cat([_reference_whiten(v, m, shift_mean) for v, m in _shards(values, mask)])
    assert not torch.allclose(local, expected, atol=1e-3)


def test_whiten_edge_cases():
    values, mask = _batch()
    out = global_masked_whiten(values.float(), mask)
    assert out.dtype == torch.float32 and (out[~mask] == 0).all()
    assert out[mask].mean().abs() < 1e-6 and out[mask].std().item() == pytest.approx(1.0, abs=1e-5)
    one = torch.zeros_like(mask)
    one[0, 0] = True
    assert torch.equal(global_masked_whiten(values, one), torch.zeros_like(values))  # n = 1: var taken as 0
    assert torch.equal(global_masked_whiten(values, torch.zeros_like(mask)), torch.zeros_like(values))
    leaf = values.clone().requires_grad_()
    global_masked_whiten(leaf, mask).sum().backward()
    assert torch.isfinite(leaf.grad).all()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.ranks
@pytest.mark.slow
def test_two_process_reduction(tmp_path):
    """torchrun with 2 gloo processes holding different slices; both agree with one process."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(_free_port()),
        str(ROOT / "tests" / "dist_reduce_worker.py"),
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    from dist_reduce_worker import RANK_ROWS, make_batch  # tests/ is on sys.path under pytest

    values, mask = make_batch()
    token = values[mask].mean().item()
    sequence = (values * mask).sum(1).mean().item()
    whiten = _reference_whiten(values, mask)
    whiten_noshift = _reference_whiten(values, mask, shift_mean=False)
    mean_of_means = sum(values[RANK_ROWS[r]][mask[RANK_ROWS[r]]].mean().item() for r in (0, 1)) / 2
    assert abs(mean_of_means - token) > 1e-3  # the split really is uneven

    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["world"] == 2 and result["backend"] == "gloo"
        rows = RANK_ROWS[rank]
        for path in ("dist", "accelerate"):
            got = result[path]
            assert got["token"] == pytest.approx(token, rel=1e-12), (rank, path)
            assert got["sequence"] == pytest.approx(sequence, rel=1e-12), (rank, path)
            assert got["sum_count"] == pytest.approx([values[mask].sum().item(), float(mask.sum())], rel=1e-12)
            assert torch.allclose(torch.tensor(got["whiten"], dtype=F64), whiten[rows], atol=1e-10), (rank, path)
            assert torch.allclose(torch.tensor(got["whiten_noshift"], dtype=F64), whiten_noshift[rows], atol=1e-10)


def test_whiten_returns_the_divisor_it_used():
    """return_std gives sqrt(unbiased var + eps) of the masked values: the scale the loss-mode KL coefficient
    is divided by (kl_loss_scale='advantage_std')."""
    values = torch.tensor([[1.0, 2.0, 4.0, 9.0], [3.0, -1.0, 0.0, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    kept = torch.tensor([1.0, 2.0, 4.0, 3.0, -1.0], dtype=torch.float64)
    whitened, std = global_masked_whiten(values, mask, return_std=True)
    assert float(std) == pytest.approx(math.sqrt(float(kept.var(unbiased=True)) + 1e-8), rel=1e-12)
    expected = (kept - kept.mean()) / std
    assert torch.allclose(whitened[mask.bool()], expected, rtol=1e-12)
    assert torch.equal(global_masked_whiten(values, mask), whitened)


def test_unit_count_is_the_rows_or_the_masked_tokens():
    from klppo.kl.reduce import unit_count

    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    for unit, expected in (("sequence", 3.0), ("token", 6.0)):
        count = unit_count(mask, unit)
        assert count.dtype == torch.float64 and count.item() == expected
