"""scripts/plot_run.py: the panels' points, what each panel draws, and the figure written from a run folder."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "plot_run.py")


def load_script():
    spec = importlib.util.spec_from_file_location("klppo_plot_run_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HISTORY = [
    {"step": 1, "kl/value": 0.1, "kl/coef": 0.05, "kl/target": 0.2, "objective/scores": 0.2},
    {"step": 2, "kl/value": 0.3, "kl/coef": 0.06, "kl/target": 0.2, "objective/scores": 0.4},
    {"step": 2, "eval/perplexity": 12.5},
]


def write_run(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoint-2").mkdir(parents=True)
    (run / "checkpoint-2" / "trainer_state.json").write_text(json.dumps({"log_history": HISTORY}))
    (run / "summary.json").write_text(json.dumps({"perplexity_before": 11.0, "perplexity_after": 12.5}))
    return run


def test_the_perplexity_panel_starts_with_the_value_the_summary_reports(tmp_path):
    """Evaluation during training logs perplexity at `eval_steps`; the summary's starting value (before any
    update) is the panel's first point, at update 0."""
    plot_run = load_script()
    state = plot_run.find_state(str(write_run(tmp_path)))
    assert state.endswith(os.path.join("checkpoint-2", "trainer_state.json"))  # the newest checkpoint's
    summary = plot_run.find_summary(state)
    assert plot_run.panel_series(HISTORY, "eval/perplexity", summary) == [(0, 11.0), (2, 12.5)]
    assert plot_run.panel_series(HISTORY, "kl/value", summary) == [(1, 0.1), (2, 0.3)]


def test_each_panel_draws_its_series_and_the_kl_panel_the_target_band(tmp_path):
    plot_run = load_script()
    summary = {"perplexity_before": 11.0}
    fig = plot_run.draw(HISTORY, summary)
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == ["KL statistic", "KL coefficient", "reward", "held-out perplexity"]
    for ax, (key, _) in zip(axes, plot_run.PANELS):
        (line,) = ax.get_lines()
        assert [tuple(p) for p in line.get_xydata()] == plot_run.panel_series(HISTORY, key, summary), key
    (band,) = axes[0].patches  # the target +-20%, in data units on the y axis
    extent = band.get_path().get_extents(band.get_patch_transform())
    assert (extent.y0, extent.y1) == (pytest.approx(0.16), pytest.approx(0.24))
    assert band.get_label() == "target +-20%"
    assert not any(ax.patches for ax in axes[1:])


def test_the_written_figure_is_the_drawn_one(tmp_path):
    """The PNG `main` writes has the figure's size in pixels and is not blank."""
    import matplotlib.image

    plot_run = load_script()
    out = plot_run.main([str(write_run(tmp_path)), "--out", str(tmp_path / "run.png")])
    assert out == str(tmp_path / "run.png")
    pixels = matplotlib.image.imread(out)
    width, height = (4 * len(plot_run.PANELS) * plot_run.DPI, 3.2 * plot_run.DPI)
    assert pixels.shape[:2] == (round(height), round(width))
    assert len({tuple(p) for p in pixels.reshape(-1, pixels.shape[-1])[::97]}) > 10  # lines, text, the band
