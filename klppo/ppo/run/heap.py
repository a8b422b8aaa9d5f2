"""glibc's heap on a CPU run: the threshold above which `malloc` maps a block of its own (`M_MMAP_THRESHOLD`), fixed
by the `klppo` command, and raised while decoding.

glibc slides that threshold up to the size of each mapped block it gives back, up to 32 MiB. After the first large
free, activation-sized tensors come from its heap, which fragments over the micro-batches of a PPO update: on a CPU,
one update of 16 responses of 256 tokens of SmolLM2-135M peaked at 5.0 GB with glibc's sliding threshold and at
3.1 GB with it fixed at 1 MiB (`docs/performance.md`, "Long responses"). While decoding, a dynamic KV cache grows
every layer's tensors by one position per step; mapped afresh each step, they cost time (16 responses of 256 tokens
decoded in 24% more CPU time at 1 MiB), so decoding runs at glibc's own ceiling, 32 MiB, where its sliding threshold
settles. The command owns its process and fixes it for responses of `LONG_RESPONSE` (128) tokens or more: at the
default job's 12 tokens the fixed threshold made an update 10-17% slower (mapping every tensor above 1 MiB afresh)
and saved nothing. A trainer built from Python leaves the allocator alone.
"""

from __future__ import annotations

import ctypes
import os
import sys
from contextlib import contextmanager

LONG_RESPONSE = 128  # tokens: the command fixes the threshold for responses this long or longer
TRAINING_THRESHOLD = 1 << 20
DECODING_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit hosts
_M_MMAP_THRESHOLD = -3  # malloc.h
_FIXED = {"libc": None}


def _glibc():
    if sys.platform != "linux":
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018  (glibc only)
    except (OSError, AttributeError):
        return None
    return libc


def fix_mmap_threshold(use_cpu: bool) -> bool:
    """For a command that owns its process and trains on a CPU under glibc: the mmap threshold fixed at 1 MiB (what
    `MALLOC_MMAP_THRESHOLD_=1048576` in the environment does), unless the environment sets a `MALLOC_*` option or
    preloads another allocator. Returns whether it was set; `decoding_heap` acts only then."""
    if os.environ.get("LD_PRELOAD") or any(k.startswith("MALLOC_") for k in os.environ):
        return False
    if not use_cpu:
        import torch

        if torch.cuda.is_available() or (getattr(torch, "xpu", None) is not None and torch.xpu.is_available()):
            return False
    libc = _glibc()
    if libc is None or libc.mallopt(_M_MMAP_THRESHOLD, TRAINING_THRESHOLD) != 1:
        return False
    _FIXED["libc"] = libc
    return True


@contextmanager
def decoding_heap():
    """The threshold at 32 MiB inside the block, 1 MiB again after it, where `fix_mmap_threshold` fixed it; else
    nothing."""
    libc = _FIXED["libc"]
    if libc is None:
        yield
        return
    libc.mallopt(_M_MMAP_THRESHOLD, DECODING_THRESHOLD)
    try:
        yield
    finally:
        libc.mallopt(_M_MMAP_THRESHOLD, TRAINING_THRESHOLD)
