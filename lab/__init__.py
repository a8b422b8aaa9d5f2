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


def paired_table(base: str, first: dict[str, dict], other: str, second: dict[str, dict], figures: list[str]) -> str:
    """A markdown table of two arms' runs (`{seed: {figure: value, ..., "passed": bool}}`): per arm each figure's
    mean ± standard error over seeds and the verdicts passed, then the paired difference (`other` minus `base`)
    over the seeds both arms ran."""
    from klppo.kl.tracking import mean_and_standard_error

    lines = ["| runs | seeds | " + " | ".join(figures) + " | verdict PASS |", "|" + " --- |" * (len(figures) + 3)]
    for name, group in ((base, first), (other, second)):
        cols = [
            f"{m:.3g} ± {se:.2g}" for m, se in (mean_and_standard_error(r[f] for r in group.values()) for f in figures)
        ]
        passed = sum(r["passed"] for r in group.values())
        lines.append(f"| {name} | {len(group)} | " + " | ".join(cols) + f" | {passed}/{len(group)} |")
    seeds = sorted(set(first) & set(second), key=int)
    diffs = [mean_and_standard_error(second[s][f] - first[s][f] for s in seeds) for f in figures]
    lines.append(
        f"| {other} minus {base}, paired | {len(seeds)} | "
        + " | ".join(f"{m:+.3g} ± {se:.2g}" for m, se in diffs)
        + " | |"
    )
    return "\n".join(lines) + "\n"
