"""The estimator and controller tables of docs/kl.md are generated code: they must equal the generators' output."""

from pathlib import Path

from klppo.kl import estimator_table_markdown, kl_estimators
from klppo.kl.divergence import main, readme_table_block, replace_readme_table

TABLES = Path(__file__).resolve().parents[1] / "docs" / "kl.md"
FIX = "run: python -m klppo.kl.divergence --write-readme docs/kl.md"


def test_estimator_table_is_up_to_date():
    block = readme_table_block(TABLES.read_text(encoding="utf-8"))
    assert block.strip() == estimator_table_markdown().strip(), FIX


def test_table_lists_every_builtin_estimator_and_full():
    table = estimator_table_markdown()
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == kl_estimators()
    assert all(row.count(" | ") == 4 for row in rows)  # five cells, no stray pipe
    k3 = next(row for row in rows if row.startswith("| `k3` |"))
    assert "no: KL(ref\\|\\|pi)" in k3


def test_replace_and_check(tmp_path):
    text = "intro\n<!-- estimator-table:start -->\nstale\n<!-- estimator-table:end -->\noutro\n"
    fresh = replace_readme_table(text)
    assert fresh.startswith("intro\n") and fresh.endswith("<!-- estimator-table:end -->\noutro\n")
    assert "stale" not in fresh and estimator_table_markdown() in fresh
    path = tmp_path / "README.md"
    path.write_text(text)
    assert main(["--check", str(path)]) == 1
    assert main(["--write-readme", str(path)]) == 0
    assert main(["--check", str(path)]) == 0
    assert path.read_text() == fresh


def test_controller_table_comes_from_the_registry():
    from klppo.kl import KLController, register_kl_controller, unregister_kl_controller
    from klppo.kl.controllers import controller_table_markdown
    from klppo.kl.divergence import CONTROLLER_TABLE_END, CONTROLLER_TABLE_START

    block = readme_table_block(TABLES.read_text(encoding="utf-8"), CONTROLLER_TABLE_START, CONTROLLER_TABLE_END)
    assert block.strip() == controller_table_markdown().strip(), FIX
    assert "| `tracking` |" in block and "`kp=0.3`" in block and "`kl_controller_kwargs` (defaults)" in block

    @register_kl_controller("throwaway")
    class Throwaway(KLController):
        """Never moves."""

        def __init__(self, kl_coef, target, step=2, floor=0.5):
            super().__init__(kl_coef)

        def next_coef(self, kl, n_steps):
            return self.value

    try:
        assert "| `throwaway` | Never moves. | `step=2`, `floor=0.5` | yes |" in controller_table_markdown()
    finally:
        unregister_kl_controller("throwaway")
    assert "throwaway" not in controller_table_markdown()
