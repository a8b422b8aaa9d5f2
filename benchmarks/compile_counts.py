"""How often a run compiles and records: dynamo's graph compilations and the CUDA graphs that torch's CUDA graph
trees record (and the eager warm-up runs before a recording), counted since the counter was made.

    counter = CompileCounter()   # before the run
    ...
    counter.snapshot()           # {"graphs": ..., "cudagraph_recordings": ..., "cudagraph_warmups": ...}

Dynamo counts its graphs itself (`torch._dynamo.utils.counters["stats"]["unique_graphs"]`); the CUDA graph trees
keep no such count, so the counter wraps the tree manager's `record_function` and `run_eager` once per process.
"""

from __future__ import annotations

_CUDAGRAPH_CALLS = {"record_function": 0, "run_eager": 0}
_PATCHED = {"done": False}


def _count_cudagraph_calls() -> None:
    """Wrap `CUDAGraphTreeManager.record_function` and `run_eager` to count their calls (once per process)."""
    if _PATCHED["done"]:
        return
    _PATCHED["done"] = True
    try:
        from torch._inductor import cudagraph_trees
    except ImportError:  # a torch without CUDA graph trees records none
        return
    manager = cudagraph_trees.CUDAGraphTreeManager
    for name in _CUDAGRAPH_CALLS:
        original = getattr(manager, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            _CUDAGRAPH_CALLS[_name] += 1
            return _original(self, *args, **kwargs)

        setattr(manager, name, counted)


class CompileCounter:
    """Counts of compiled graphs and CUDA graph recordings since it was made (or since `since`)."""

    def __init__(self):
        _count_cudagraph_calls()
        self.start = self._totals()

    @staticmethod
    def _totals() -> dict[str, int]:
        from torch._dynamo.utils import counters

        return {
            "graphs": int(counters["stats"]["unique_graphs"]),
            "cudagraph_recordings": _CUDAGRAPH_CALLS["record_function"],
            "cudagraph_warmups": _CUDAGRAPH_CALLS["run_eager"],
        }

    def snapshot(self) -> dict[str, int]:
        """The counts since the start."""
        now = self._totals()
        return {key: now[key] - self.start[key] for key in now}


def per_step(snapshots: list[dict[str, int]]) -> list[dict[str, int]]:
    """The increments between consecutive cumulative snapshots (the first one taken from zero)."""
    previous = {key: 0 for key in (snapshots[0] if snapshots else {})}
    steps = []
    for snap in snapshots:
        steps.append({key: snap[key] - previous[key] for key in snap})
        previous = snap
    return steps
