"""One run per output_dir: a lock file held for the run's lifetime."""

from __future__ import annotations

import json
import logging
import os
import socket

logger = logging.getLogger(__name__)

LOCK_NAME = ".klppo.lock"


class OutputDirInUse(RuntimeError):
    """Another live run holds the output directory."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class OutputDirLock:
    """Context manager: create `output_dir/.klppo.lock` (pid and host) or fail at once with one paragraph.

    A lock left by a process that no longer runs on this host is taken over with a warning. A lock from
    another host is respected (its process cannot be checked from here). `enabled=False` (other ranks of a
    distributed run) does nothing.
    """

    def __init__(self, output_dir: str, enabled: bool = True):
        self.path = os.path.join(output_dir, LOCK_NAME)
        self.enabled = enabled
        self.held = False

    def __enter__(self) -> "OutputDirLock":
        if not self.enabled:
            return self
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        me = {"pid": os.getpid(), "host": socket.gethostname()}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                other = self._read()
                if other.get("pid") == me["pid"] and other.get("host") == me["host"]:
                    return self  # this process holds it already (the CLI around the trainer): not ours to release
                if other.get("host") == me["host"] and isinstance(other.get("pid"), int) and not _alive(other["pid"]):
                    logger.warning("Taking over %s, left by process %s, which no longer runs.", self.path, other["pid"])
                    os.remove(self.path)
                    continue
                raise OutputDirInUse(
                    f"Another klppo run (pid {other.get('pid')} on {other.get('host')}) is using output_dir "
                    f"{os.path.dirname(self.path)!r}: two runs in one folder would mix their checkpoints. Wait for it "
                    f"to finish, choose another --output_dir, or delete {self.path} if that run is gone."
                ) from None
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return self
        raise OutputDirInUse(f"Could not take the lock {self.path}; delete it if no run uses that folder.")

    def _read(self) -> dict:
        try:
            with open(self.path) as f:
                data = json.load(f)
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def __exit__(self, *exc) -> None:
        if self.held:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass
            self.held = False
