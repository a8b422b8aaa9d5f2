"""The configuration's surface: every field documented once, in its class's docstring; the public fields few,
the research settings behind `experimental`; the documents built from those texts current; `--help` working."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import TrainingArguments

from klppo import KLPPOConfig
from klppo.kl.config import KL_CONTROL_DOC, KLControlConfig
from klppo.ppo.config import EXPERIMENTAL_DOC, EXPERIMENTAL_KEYS, KLPPO_CONFIG_DOC, ExperimentalSettings


def _flat(text: str) -> str:
    return " ".join(text.split())


def public_fields() -> list[str]:
    """KLPPOConfig's fields that are not TrainingArguments' own, and the TrainingArguments fields it redefines."""
    inherited = {f.name: f for f in dataclasses.fields(TrainingArguments)}
    return [
        f.name
        for f in dataclasses.fields(KLPPOConfig)
        if f.name not in inherited or f.default is not inherited[f.name].default
    ]


def test_every_field_is_documented_once_in_its_class_docstring():
    docs = _flat(KL_CONTROL_DOC + KLPPO_CONFIG_DOC)
    fields = {f.name: f for f in dataclasses.fields(KLPPOConfig)}
    for name in public_fields():
        help_text = fields[name].metadata["help"].replace("%%", "%")
        assert help_text and help_text in docs, name
    for name in (f.name for f in dataclasses.fields(KLControlConfig)):
        assert name in fields, name  # KLPPOConfig has every KL field
    experimental = _flat(EXPERIMENTAL_DOC)
    for name in EXPERIMENTAL_KEYS:
        assert f"{name} (" in experimental, name


def test_the_public_fields_are_at_most_37_and_the_rest_is_experimental(tmp_path):
    """37: the 35 of the last rounds, `cache_implementation` (how generation decodes: a user's choice on a GPU) and
    `use_vllm` (which engine decodes; the engine's own settings are experimental)."""
    assert len(public_fields()) <= 37, public_fields()
    assert not set(EXPERIMENTAL_KEYS) & set(public_fields())
    args = KLPPOConfig(
        output_dir=str(tmp_path),
        report_to="none",
        kl_target=2.0,
        experimental={"kl_guard": False, "health_patience": 5},
    )
    x = args.experimental
    assert isinstance(x, ExperimentalSettings)
    assert x.kl_guard is False and x.health_patience == 5 and x.kl_statistic == "full"
    assert not hasattr(args, "kl_guard") and not hasattr(args, "health_patience")  # read through `experimental` only
    # serialised as a mapping, resolved (wandb's config, a saved config), and built again from it
    saved = json.loads(args.to_json_string())["experimental"]
    assert saved == {**dataclasses.asdict(x), "kl_statistic": None}  # what klppo chose is written unset
    assert KLPPOConfig(output_dir=str(tmp_path), report_to="none", kl_target=2.0, experimental=saved).experimental == x
    untargeted = KLPPOConfig(output_dir=str(tmp_path), report_to="none", experimental=saved)
    assert untargeted.experimental.kl_statistic == "k1"  # chosen again for the new config
    # a rebuilt config (dataclasses.replace) chooses again what klppo chose; what the user set stays
    rebuilt = dataclasses.replace(args, kl_target=None, kl_controller="fixed")
    assert (rebuilt.experimental.kl_statistic, rebuilt.experimental.kl_guard) == ("k1", False)
    assert rebuilt.experimental.health_patience == 5 and rebuilt.automatic == {"kl_statistic": "k1"}
    with pytest.raises(ValueError, match="no setting 'kl_gaurd'.*kl_statistic, kl_guard"):
        KLPPOConfig(output_dir=str(tmp_path), report_to="none", experimental={"kl_gaurd": False})
    with pytest.raises(ValueError, match="must be a mapping of settings.*its settings are: kl_statistic, kl_guard"):
        KLPPOConfig(output_dir=str(tmp_path), report_to="none", experimental="[1]")
    with pytest.raises(ValueError, match="`health_patience` must be >= 1"):
        KLPPOConfig(output_dir=str(tmp_path), report_to="none", experimental='{"health_patience": 0}')


def test_help_prints_every_field_and_exits_0():
    script = Path(__file__).resolve().parents[1] / "scripts" / "train.py"
    proc = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name in (*public_fields(), "experimental", "dataset_name", "reward_funcs", "model_name_or_path"):
        assert f"--{name}" in proc.stdout, name


def test_the_documents_built_from_the_docstrings_are_current():
    """docs/configuration.md's field tables and the README's table of common fields are rebuilt from the
    docstrings (`python -m klppo.config_docs --write`); a field whose doc changed without them fails here."""
    from klppo.config_docs import built_documents

    root = Path(__file__).resolve().parents[1]
    for path, text in built_documents(str(root)).items():
        assert Path(path).read_text(encoding="utf-8") == text, (
            f"{path} is out of date: python -m klppo.config_docs --write"
        )


def test_a_switch_of_the_experimental_settings_must_be_a_bool(tmp_path):
    """A string such as "false" would read as on: `kl_loss_baseline` (like the other switches) is refused at parse
    time, naming the valid values."""
    with pytest.raises(ValueError, match="`kl_loss_baseline` must be true or false, got 'false'"):
        KLPPOConfig(output_dir=str(tmp_path), report_to="none", experimental={"kl_loss_baseline": "false"})
    with pytest.raises(ValueError, match="`vllm_enforce_eager` must be true, false or unset, got 'no'"):
        KLPPOConfig(output_dir=str(tmp_path), report_to="none", experimental={"vllm_enforce_eager": "no"})


def test_each_documented_default_is_the_codes():
    """Every field's docstring entry says what it defaults to (`name (`type`, *optional*, defaults to `X`)`), and
    X is the dataclass's default: for each public field of `KLPPOConfig` and each experimental setting."""
    import ast
    import re

    entry = re.compile(r"(\w+) \(`[^)]*?, \*optional\*, defaults to `([^`]*)`")
    for doc, cls, names in (
        (KL_CONTROL_DOC + KLPPO_CONFIG_DOC, KLPPOConfig, public_fields()),
        (EXPERIMENTAL_DOC, ExperimentalSettings, EXPERIMENTAL_KEYS),
    ):
        documented = dict(entry.findall(_flat(doc)))
        fields = {f.name: f for f in dataclasses.fields(cls)}
        assert set(names) <= set(documented), sorted(set(names) - set(documented))
        for name in names:
            field = fields[name]
            code = field.default if field.default is not dataclasses.MISSING else field.default_factory()
            said = ast.literal_eval(documented[name])
            assert said == code and isinstance(said, bool) == isinstance(code, bool), (name, said, code)


@pytest.mark.parametrize(
    "mode, estimator, kwargs, groups",
    [
        ("loss", "k2", None, 8),
        ("loss", "k3+", {"coef_min": 1e-3}, 8),
        ("loss", "k2", {"jackknife_groups": 0}, 0),
        ("loss", "k3", None, None),
        ("loss", "k3", {"jackknife_groups": 8}, 8),
        ("both", "k1", None, None),
        ("reward", "k1", None, None),
    ],
)
def test_the_equilibrium_controller_filters_its_estimate_by_default_with_a_kl_in_the_loss(
    mode, estimator, kwargs, groups, tmp_path
):
    """With a KL in the loss that trains toward the tilt (`k2`, `k3+`) klppo's trainer gives the equilibrium
    controller `jackknife_groups: 8` unless the user's mapping sets it (0 keeps the filter off), and records it among
    its automatic choices; with `k3` in the loss (its forward-KL optimum), a KL in the reward or in both, and for
    TRL's trainers (`KLControlConfig` alone), the constants are the user's."""
    args = KLPPOConfig(
        output_dir=str(tmp_path), kl_mode=mode, kl_estimator=estimator, kl_target=1.0, kl_controller_kwargs=kwargs
    )
    assert args.kl_controller == "equilibrium"
    assert (args.kl_controller_kwargs or {}).get("jackknife_groups") == groups
    assert ("kl_controller_kwargs" in args.automatic) == (groups == 8 and "jackknife_groups" not in (kwargs or {}))
    plain = KLControlConfig(kl_mode=mode, kl_estimator=estimator, kl_target=1.0, kl_controller_kwargs=kwargs)
    assert plain.kl_controller_kwargs == kwargs
    assert {k: v for k, v in (args.kl_controller_kwargs or {}).items() if k != "jackknife_groups"} == {
        k: v for k, v in (kwargs or {}).items() if k != "jackknife_groups"
    }
