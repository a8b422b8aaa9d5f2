"""A rank blocked in a collective, for `tests/test_preemption.py`: two gloo ranks meet once; then rank 1 stops
(SIGSTOP: a peer that died on another machine leaves its connections open, so nothing tells rank 0), and rank 0, with
klppo's SIGTERM handling installed (`StopRequest(grace_s=GRACE_S)`), prints `waiting` and waits in a barrier.

    python tests/blocked_rank_worker.py RANK PORT GRACE_S
"""

import datetime
import os
import signal
import sys

import torch.distributed as dist

from klppo.ppo.run.preemption import StopRequest

if __name__ == "__main__":
    rank, port, grace = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=300)
    )
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
        sys.exit(0)
    request = StopRequest(grace_s=grace)
    assert request.install()
    print("waiting", flush=True)
    dist.barrier()
    print("the barrier returned", flush=True)
