"""Worker for tests/test_kl_reduce.py::test_two_process_reduction (run by torchrun, not by pytest).

    python -m torch.distributed.run --nproc_per_node 2 tests/dist_reduce_worker.py OUT_DIR

Each rank holds a different slice of one deterministic batch (different numbers of sequences and
tokens), computes the global statistics through torch.distributed and through an
``accelerate.Accelerator``, and writes them to OUT_DIR/rank{R}.json.
"""

import json
import os
import sys
from pathlib import Path

import torch

from klppo.kl import global_masked_whiten, kl_statistic, reduce_sum_count

# rows held by each rank: 2 sequences / 10 tokens on rank 0, 3 sequences / 12 tokens on rank 1
RANK_ROWS = {0: slice(0, 2), 1: slice(2, 5)}
LENGTHS = [7, 3, 5, 1, 6]


def make_batch():
    """values [5, 7] float64, mask [5, 7] bool: the whole batch, identical on every process."""
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(5, 7, generator=gen, dtype=torch.float64) * 0.3 + 0.1
    mask = torch.zeros(5, 7, dtype=torch.bool)
    for row, n in enumerate(LENGTHS):
        mask[row, :n] = True
    return values, mask


def statistics(values, mask, accelerator):
    return {
        "token": kl_statistic(values, mask, "token", accelerator=accelerator).item(),
        "sequence": kl_statistic(values, mask, "sequence", accelerator=accelerator).item(),
        "whiten": global_masked_whiten(values, mask, accelerator=accelerator).tolist(),
        "whiten_noshift": global_masked_whiten(values, mask, accelerator=accelerator, shift_mean=False).tolist(),
        "sum_count": [t.item() for t in reduce_sum_count(values[mask].sum(), mask.sum(), accelerator)],
    }


def main(out_dir: str) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)  # initialises the gloo process group from torchrun's env
    assert torch.distributed.is_initialized(), "expected a process group"
    rank, world = accelerator.process_index, accelerator.num_processes
    values, mask = make_batch()
    rows = RANK_ROWS[rank]
    local_values, local_mask = values[rows], mask[rows]
    result = {
        "rank": rank,
        "world": world,
        "backend": torch.distributed.get_backend(),
        "dist": statistics(local_values, local_mask, None),
        "accelerate": statistics(local_values, local_mask, accelerator),
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1])
