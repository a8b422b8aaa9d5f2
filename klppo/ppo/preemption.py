"""A stop signal keeps the run's work: SIGTERM ends the run at the next update boundary with a checkpoint.

Clusters stop jobs with SIGTERM and a grace period (SLURM's preemption and time limits, Kubernetes evictions, spot
instances). While `KLPPOTrainer.train` runs, the first SIGTERM only records that a stop was asked for. At the end of
each update, every rank contributes what it saw to one all-reduce, so that all ranks stop after the same update, even
when the signal reached them at different moments. The trainer then writes a checkpoint of that update through its
usual atomic save and returns, marking the run as stopped (`KLPPOTrainer.stopped_by_signal`).

A launcher forwards the signal it gets to its ranks (torch's elastic agent, under `torchrun` and `accelerate
launch`), so a rank sent the signal through its process group gets it twice within moments: a second SIGTERM within
`DUPLICATE_WINDOW_S` of the first is that same request. A later one stops the process at once, as SIGTERM does by
default; SIGINT (Ctrl-C) always does.

transformers' own `enable_jit_checkpoint` does not serve here: each rank's timer decides on its own when it stops,
and ranks that stop after different updates meet different collectives.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import torch

logger = logging.getLogger(__name__)

DUPLICATE_WINDOW_S = 5.0
# the exit status of a run stopped by SIGTERM after saving its checkpoint (128 + SIGTERM, the shell's convention)
EXIT_STOPPED = 128 + int(signal.SIGTERM)


class StopRequest:
    """SIGTERM, recorded while installed (`install` / `uninstall`, from the main thread), agreed on across ranks at
    update boundaries (`agreed`)."""

    def __init__(self):
        self.received_at: float | None = None
        self._previous = None
        self._installed = False

    @classmethod
    def for_trainer(cls, trainer) -> "StopRequest":
        """A trainer's request, with transformers' `enable_jit_checkpoint` callback taken off it when the field asked
        for one (`replace_jit_checkpoint`): klppo's handling does its job."""
        if replace_jit_checkpoint(trainer) and trainer.is_world_process_zero():
            logger.info("enable_jit_checkpoint: klppo saves a checkpoint on SIGTERM itself (experimental "
                        "checkpoint_on_sigterm, on by default), every rank after the same update.")  # fmt: skip
        return cls()

    @property
    def requested(self) -> bool:
        return self.received_at is not None

    def install(self) -> bool:
        """Handle SIGTERM from now on; False (nothing installed) outside the main thread, where Python cannot."""
        if self._installed or threading.current_thread() is not threading.main_thread():
            return False
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        self._installed = True
        return True

    def uninstall(self) -> None:
        """Give SIGTERM back the handler it had before `install`."""
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False

    def _handle(self, signum, frame) -> None:
        # a signal handler: record only (logging here could deadlock on a lock the interrupted code holds)
        now = time.monotonic()
        if self.received_at is None:
            self.received_at = now
            return
        if now - self.received_at < DUPLICATE_WINDOW_S:  # the launcher forwarding the same request
            return
        self.uninstall()  # a second request: stop at once, as SIGTERM does by default
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    def agreed(self, accelerator) -> bool:
        """Whether any rank has received SIGTERM: one all-reduce when there are several ranks, the same answer on
        every rank."""
        if accelerator.num_processes == 1:
            return self.requested
        flag = torch.tensor([float(self.requested)], device=accelerator.device)
        return bool(accelerator.reduce(flag, reduction="sum").item() > 0)


def replace_jit_checkpoint(trainer) -> bool:
    """Remove transformers' `enable_jit_checkpoint` callback from `trainer`, when the field asked for it, and give
    SIGTERM back the handler it replaced: that callback stops each rank on its own timer, and klppo's own handling
    does its job with every rank stopping after the same update. Returns whether there was one."""
    try:
        from transformers.trainer_jit_checkpoint import JITCheckpointCallback
    except ImportError:  # a transformers release without it
        return False
    callback = next((c for c in trainer.callback_handler.callbacks if isinstance(c, JITCheckpointCallback)), None)
    if callback is None:
        return False
    trainer.remove_callback(callback)
    manager = callback.jit_manager
    if manager is not None and manager._original_sigterm_handler is not None:
        signal.signal(signal.SIGTERM, manager._original_sigterm_handler)
    return True
