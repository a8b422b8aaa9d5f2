"""The README holds together for a newcomer: every Python block runs as written, the table of what klppo has been
shown to do links each row to its evidence, and the page stays short.

The Python blocks run in order, in one namespace, as in one interactive session: the step-by-step block goes on
with the `trainer` of the example before it. They run on the tiny random model instead of SmolLM2 and for one
update: the strings of `SUBSTITUTIONS` are replaced, and each must still be found in the README, so that a changed
example fails here instead of silently running something else. Nothing else in the code is changed."""

from __future__ import annotations

import math
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# (what the README says, what the test runs instead): the tiny model, one update, short responses
SUBSTITUTIONS = (
    ("klppo:smollm2-135m-instruct", "klppo:tiny-llama"),
    ("max_steps=10", "max_steps=1"),  # the KLPPOTrainer example
    ("max_steps=20", "max_steps=1"),  # the GRPOTrainer example
    ("response_length=24", "response_length=4"),
    ("max_completion_length=12", "max_completion_length=4"),
)
MAX_LINES = 300


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.M | re.S)


def test_every_python_block_runs_as_written(tmp_path, monkeypatch, capsys):
    text = README.read_text(encoding="utf-8")
    blocks = python_blocks(text)
    assert len(blocks) >= 3, "the README's Python blocks are no longer found"
    code = "\n".join(blocks)
    for old, new in SUBSTITUTIONS:
        assert old in code, f"the README's Python blocks no longer have {old!r}: update SUBSTITUTIONS"
    monkeypatch.chdir(tmp_path)  # the blocks' relative output folders land here
    monkeypatch.setenv("WANDB_MODE", "disabled")
    from klppo import KLPPOTrainer

    namespace: dict = {}
    ppo_trainers = []
    for number, block in enumerate(blocks, 1):
        for old, new in SUBSTITUTIONS:
            block = block.replace(old, new)
        exec(compile(block, f"README.md, Python block {number}", "exec"), namespace)
        if isinstance(namespace.get("trainer"), KLPPOTrainer):
            ppo_trainers.append(namespace["trainer"])
    out = capsys.readouterr().out

    # the first block: one PPO update with the KL logged, and the coefficient and statistic printed
    ppo = ppo_trainers[0]
    assert ppo.state.global_step == 1
    logged = [h for h in ppo.state.log_history if "kl/coef" in h]
    assert len(logged) == 1 and math.isfinite(logged[0]["kl/value"])
    assert f"{ppo.kl_controller.value} {logged[0]['kl/value']}" in out
    # the step-by-step block: an optimisation of its own rollout, its health metrics printed
    result = namespace["result"]
    approxkl, clipfrac = result.metrics["policy/approxkl"], result.metrics["policy/clipfrac"]
    assert math.isfinite(approxkl) and 0 <= clipfrac <= 1
    assert f"{approxkl} {clipfrac}" in out
    # the GRPO block: TRL's trainer took one step with klppo's controller setting its beta
    grpo = namespace["trainer"]
    assert type(grpo).__name__ == "GRPOTrainer" and grpo.state.global_step == 1
    assert any("kl/coef" in h and "kl/target" in h for h in grpo.state.log_history)


def test_the_readme_is_short_and_its_evidence_table_links_to_the_results():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= MAX_LINES
    section = text.split("## What klppo has been shown to do", 1)[1].split("\n## ", 1)[0]
    rows = [
        line for line in section.splitlines() if line.startswith("| ") and not line.startswith(("| claim", "| ---"))
    ]
    assert len(rows) >= 5
    for row in rows:
        assert re.search(r"\]\(docs/results\.md#[\w-]+\)", row), row  # test_docs checks that the anchor exists


def test_the_first_screen_has_the_two_commands_and_the_pip_install():
    """What a newcomer reads first: the default job, the test command (both kept as `.ci/run` and the tests read
    them), and the install into an environment of one's own."""
    first = "\n".join(README.read_text(encoding="utf-8").splitlines()[:60])
    assert "bash scripts/setup.sh && .venv/bin/python scripts/train.py --config configs/default.yaml\n" in first
    assert "Run the tests:" in first
    assert 'pip install ".[' in first and "klppo train --config" in first
