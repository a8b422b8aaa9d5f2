"""One run per output_dir: `filelock`'s lock on `output_dir/.klppo.lock`, held for the run's lifetime.

The operating system releases the lock when the process holding it ends, however it ends, so a lock left by a
crashed run never blocks the next one. Who holds it (pid, host) is written beside it, in `.klppo.owner`, for the
message a second run gets.
"""

from __future__ import annotations

import json
import os
import socket

from filelock import FileLock, Timeout

LOCK_NAME = ".klppo.lock"
OWNER_NAME = ".klppo.owner"


class OutputDirInUse(RuntimeError):
    """Another live run holds the output directory."""


class OutputDirLock:
    """Context manager: hold `output_dir`'s lock, or fail at once with one paragraph naming the run that holds it.

    Taking it again in the same process (the command line around the trainer) is allowed: the outer holder releases
    it. `enabled=False` (the other ranks of a distributed run) does nothing."""

    def __init__(self, output_dir: str, enabled: bool = True):
        self.path = os.path.join(output_dir, LOCK_NAME)
        self.owner_path = os.path.join(output_dir, OWNER_NAME)
        self.enabled = enabled
        self.held = False  # taken here, not by an outer holder in this process

    def __enter__(self) -> "OutputDirLock":
        if not self.enabled:
            return self
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        self.lock = FileLock(self.path, is_singleton=True)  # one instance per file in a process: re-entrant
        outer = self.lock.is_locked
        try:
            self.lock.acquire(blocking=False)
        except Timeout:
            other = self._owner()
            raise OutputDirInUse(
                f"Another klppo run (pid {other.get('pid')} on {other.get('host')}) is using output_dir "
                f"{os.path.dirname(self.path)!r}: two runs in one folder would mix their checkpoints. Wait for it to "
                "finish, or choose another --output_dir."
            ) from None
        if not outer:
            with open(self.owner_path, "w") as f:
                json.dump({"pid": os.getpid(), "host": socket.gethostname()}, f)
            self.held = True
        return self

    def _owner(self) -> dict:
        try:
            with open(self.owner_path) as f:
                data = json.load(f)
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        if self.held:
            try:
                os.remove(self.owner_path)
            except FileNotFoundError:
                pass
            self.held = False
        self.lock.release()
