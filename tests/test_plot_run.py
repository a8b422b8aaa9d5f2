"""scripts/plot_run.py: the panels' points, and the figure written from a run folder."""

from __future__ import annotations

import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "plot_run.py")


def load_script():
    spec = importlib.util.spec_from_file_location("klppo_plot_run_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_perplexity_panel_starts_with_the_value_the_summary_reports(tmp_path):
    """Evaluation during training logs perplexity at `eval_steps`; the summary's starting value (before any
    update) is the panel's first point, at update 0."""
    plot_run = load_script()
    history = [
        {"step": 1, "kl/value": 0.1, "kl/coef": 0.05, "objective/scores": 0.2},
        {"step": 2, "kl/value": 0.3, "kl/coef": 0.06, "objective/scores": 0.4},
        {"step": 2, "eval/perplexity": 12.5},
    ]
    run = tmp_path / "run"
    (run / "checkpoint-2").mkdir(parents=True)
    (run / "checkpoint-2" / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    (run / "summary.json").write_text(json.dumps({"perplexity_before": 11.0, "perplexity_after": 12.5}))
    state = plot_run.find_state(str(run))
    summary = plot_run.find_summary(state)
    assert plot_run.panel_series(history, "eval/perplexity", summary) == [(0, 11.0), (2, 12.5)]
    assert plot_run.panel_series(history, "kl/value", summary) == [(1, 0.1), (2, 0.3)]
    out = plot_run.main([str(run), "--out", str(tmp_path / "run.png")])
    assert os.path.getsize(out) > 0
