"""klppo's lab: the experiments behind the figures in `docs/results.md`, kept apart from the product.

Not installed with klppo (the package is `klppo` alone); run each from the repository root as a module, e.g.

    python -m lab.compare --quick --out /tmp/compare-quick
    python -m lab.controller_grid --table results/controller_grid/grid.jsonl

Their data and the reading of it live under `results/`; the tests of this code are marked `lab`
(`pytest -m "not lab"` leaves them out).
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType


def import_plugin(name: str) -> ModuleType:
    """Import a module that registers controllers or guards of its own (`--plugin` of the lab's runners): a module
    of the lab by its short name (`controller_ablations` is `lab.controller_ablations`), else any importable
    module. One name per module, so that nothing registers twice."""
    if "." not in name and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        name = f"{__name__}.{name}"
    return importlib.import_module(name)
