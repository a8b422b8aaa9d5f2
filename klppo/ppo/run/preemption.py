"""A stop signal keeps the run's work: SIGTERM ends the run at the next update boundary with a checkpoint.

Clusters stop jobs with SIGTERM and a grace period (SLURM's preemption and time limits, Kubernetes evictions, spot
instances). While `KLPPOTrainer.train` runs, the first SIGTERM only records that a stop was asked for. At the end of
each update, every rank contributes what it saw to one all-reduce, so that all ranks stop after the same update, even
when the signal reached them at different moments. The trainer then writes a checkpoint of that update through its
usual atomic save and returns, marking the run as stopped (`KLPPOTrainer.stopped_by_signal`).

A launcher forwards the signal it gets to its ranks (torch's elastic agent, under `torchrun` and `accelerate
launch` with several processes), so a rank sent the signal through its process group gets it twice within moments: a
second SIGTERM within `DUPLICATE_WINDOW_S` of the first is that same request. SIGINT (Ctrl-C) stops at once.

A Python signal handler runs only when the main thread gets back to the interpreter, which a rank waiting in a
collective for a peer that has died never does. So a watcher thread, woken through `signal.set_wakeup_fd` (which the
C-level handler writes at once, whatever the main thread is doing), ends the process (`os._exit`, status 143, no
checkpoint) at a later SIGTERM, and, with several ranks, when the run has not stopped `grace_s` seconds after the first
one: `TORCH_ELASTIC_SHUTDOWN_TIMEOUT` (30 by default), after which torch's elastic agent kills its ranks anyway.

accelerate's single-process launcher (`accelerate launch` on one process: its simple launcher) starts the script as a
child and dies at the signal without waiting for it, so the job ends before the checkpoint is written: one process is
launched as `python scripts/train.py`.

transformers' own `enable_jit_checkpoint` does not serve here: each rank's timer decides on its own when it stops,
and ranks that stop after different updates meet different collectives.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time

import torch

logger = logging.getLogger(__name__)

DUPLICATE_WINDOW_S = 5.0
# the exit status of a run stopped by SIGTERM (128 + SIGTERM, the shell's convention): after saving its checkpoint,
# or, from the watcher, at once
EXIT_STOPPED = 128 + int(signal.SIGTERM)


def shutdown_grace_s() -> float:
    """The seconds a rank has, after a SIGTERM, to finish its update and save it: `TORCH_ELASTIC_SHUTDOWN_TIMEOUT`, the
    time torch's elastic agent (`torchrun`, `accelerate launch` with several processes) leaves its ranks before it
    kills them (30 by default)."""
    try:
        return float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))
    except ValueError:
        return 30.0


class StopRequest:
    """SIGTERM, recorded while installed (`install` / `uninstall`, from the main thread), agreed on across ranks at
    update boundaries (`agreed`). While installed, a watcher thread ends the process at a second SIGTERM (one more than
    `DUPLICATE_WINDOW_S` after the first) and, when `grace_s` is set, `grace_s` seconds after the first, even while
    the main thread is blocked in a collective."""

    def __init__(self, grace_s: float | None = None):
        self.received_at: float | None = None
        self.grace_s = grace_s
        self._previous = None
        self._installed = False
        self._pipe: tuple[int, int] | None = None  # the watcher's (read, write) ends; the write end is the wakeup fd
        self._previous_wakeup_fd = -1
        self._watcher: threading.Thread | None = None

    @classmethod
    def for_trainer(cls, trainer) -> "StopRequest":
        """A trainer's request, with transformers' `enable_jit_checkpoint` callback taken off it when the field asked
        for one (`replace_jit_checkpoint`): klppo's handling does its job. With several ranks, one that has not
        stopped `shutdown_grace_s()` seconds after the signal exits (it may be waiting for a peer that died)."""
        if replace_jit_checkpoint(trainer) and trainer.is_world_process_zero():
            logger.info(
                "enable_jit_checkpoint: klppo saves a checkpoint on SIGTERM itself (experimental "
                "checkpoint_on_sigterm, on by default), every rank after the same update."
            )
        return cls(grace_s=shutdown_grace_s() if trainer.accelerator.num_processes > 1 else None)

    @property
    def requested(self) -> bool:
        return self.received_at is not None

    def install(self) -> bool:
        """Handle SIGTERM from now on; False (nothing installed) outside the main thread, where Python cannot."""
        if self._installed or threading.current_thread() is not threading.main_thread():
            return False
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        read, write = os.pipe()
        try:
            os.set_blocking(write, False)  # the C-level handler must never block on it
            self._previous_wakeup_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except (ValueError, OSError):  # a platform whose wakeup fd must be a socket (Windows): no watcher
            os.close(read)
            os.close(write)
        else:
            self._pipe = (read, write)
            self._watcher = threading.Thread(
                target=self._watch, args=(read, self._previous_wakeup_fd), name="klppo-sigterm-watcher", daemon=True
            )
            self._watcher.start()
        self._installed = True
        return True

    def uninstall(self) -> None:
        """Give SIGTERM back the handler it had before `install`, and stop the watcher."""
        if not self._installed:
            return
        signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
        if self._watcher is not None:
            signal.set_wakeup_fd(self._previous_wakeup_fd)
            read, write = self._pipe
            os.close(write)  # the watcher reads the end of the pipe and returns
            self._watcher.join(timeout=5)
            if not self._watcher.is_alive():
                os.close(read)
        self._installed, self._pipe, self._watcher = False, None, None

    def _handle(self, signum, frame) -> None:
        # a signal handler: record only (logging here could deadlock on a lock the interrupted code holds); the
        # watcher, woken by the same signal, handles a second one and the grace period
        if self.received_at is None:
            self.received_at = time.monotonic()

    def _watch(self, read: int, forward: int) -> None:
        """The watcher thread: reads the signal numbers the C-level handler writes into the pipe (forwarding them to
        the wakeup fd set before, if any), and ends the process at a second SIGTERM or at the grace deadline."""
        first = deadline = None
        pipe = select.poll()  # not select.select: a training process may hold more than 1024 files
        pipe.register(read, select.POLLIN)
        while True:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic()) * 1000
            if not pipe.poll(timeout):
                self._exit(
                    f"the run has not stopped {self.grace_s:g} s after SIGTERM (a rank may be waiting for "
                    "another that died)"
                )
                return
            data = os.read(read, 512)
            if not data:  # `uninstall` closed the pipe
                return
            if forward >= 0:
                try:
                    os.write(forward, data)
                except OSError:
                    pass
            if int(signal.SIGTERM) not in data:
                continue
            now = time.monotonic()
            if first is None:
                first = now
                deadline = now + self.grace_s if self.grace_s is not None else None
            elif now - first >= DUPLICATE_WINDOW_S:  # not the launcher forwarding the first one: stop at once
                self._exit("a second SIGTERM")
                return

    @staticmethod
    def _exit(why: str) -> None:
        # from the watcher thread, while the main thread may hold any lock: no logging, no flushing, no cleanup
        message = f"klppo: {why}: exiting without saving the update in progress (status {EXIT_STOPPED}).\n"
        try:
            os.write(2, message.encode())
        finally:
            os._exit(EXIT_STOPPED)

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
