"""The configuration's documents, built from the config classes' docstrings (each field is documented once, there):
the field tables of `docs/configuration.md` and the README's table of the fields most users set.

    python -m klppo.config_docs --write     # rebuild them
    python -m klppo.config_docs --check     # exit 1 when either is out of date (the suite checks this)
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import MISSING, fields

from .kl.config import KL_CONTROL_DOC, field_docs
from .ppo.config import (
    _EXPERIMENTAL_DOCS,
    _FIELD_DOCS,
    EXPERIMENTAL_DOC,
    EXPERIMENTAL_KEYS,
    KLPPO_CONFIG_DOC,
    ExperimentalSettings,
    KLPPOConfig,
)

CONFIG_TABLES_START, CONFIG_TABLES_END = "<!-- config-fields:start -->", "<!-- config-fields:end -->"
COMMON_TABLE_START, COMMON_TABLE_END = "<!-- common-fields:start -->", "<!-- common-fields:end -->"
# the README's table: the fields most users set, by the class that holds them
COMMON_FIELDS = (
    "model_name_or_path",
    "use_peft",
    "lora_r",
    "reward_funcs",
    "reward_weights",
    "dataset_name",
    "kl_target",
    "kl_target_unit",
    "kl_coef",
    "kl_mode",
    "kl_estimator",
    "kl_controller",
    "learning_rate",
    "per_device_train_batch_size",
    "num_mini_batches",
    "num_ppo_epochs",
    "max_steps",
    "response_length",
    "temperature",
    "stop_token",
    "critic",
    "output_dir",
    "report_to",
)


def doc_sections(doc: str) -> list[tuple[str, list[str]]]:
    """`[(heading, [field names])]` of a docstring's `Parameters:` section, in order (`> Heading` lines)."""
    sections: list[tuple[str, list[str]]] = []
    for line in doc.split("Parameters:", 1)[1].splitlines():
        if line.strip().startswith(">"):
            sections.append((line.strip()[1:].strip(), []))
        elif line.startswith(" " * 8) and not line.startswith(" " * 9) and line.rstrip().endswith(":"):
            if not sections:
                sections.append(("", []))
            sections[-1][1].extend(re.findall(r"\w+", re.sub(r"\([^)]*\)", "", line)))
    return sections


def _default(cls, name: str) -> str:
    f = {f.name: f for f in fields(cls)}[name]
    value = f.default_factory() if f.default_factory is not MISSING else f.default
    if value is None or value == "" or value == []:
        return "automatic" if "`None`:" in f.metadata.get("help", "") else ""
    return f"`{value.value if hasattr(value, 'value') else value}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def configuration_markdown() -> str:
    """The field tables of `docs/configuration.md`: every KL, PPO and rollout field with its default and its doc,
    grouped as the docstrings group them, then the experimental settings."""
    docs = {**field_docs(KL_CONTROL_DOC), **_FIELD_DOCS}
    lines = ["Generated from the config classes' docstrings by `python -m klppo.config_docs --write`.", ""]
    for heading, names in doc_sections(KL_CONTROL_DOC) + doc_sections(KLPPO_CONFIG_DOC):
        lines += [f"### {heading}", "", "| field | default | meaning |", "| --- | --- | --- |"]
        lines += [f"| `{name}` | {_default(KLPPOConfig, name)} | {_cell(docs[name])} |" for name in names]
        lines.append("")
    lines += [
        "### Experimental settings",
        "",
        _cell(EXPERIMENTAL_DOC.split("Parameters:")[0]),
        "",
        "| key | default | meaning |",
        "| --- | --- | --- |",
    ]
    for name in EXPERIMENTAL_KEYS:
        lines.append(f"| `{name}` | {_default(ExperimentalSettings, name)} | {_cell(_EXPERIMENTAL_DOCS[name])} |")
    return "\n".join(lines) + "\n"


def _first_sentence(text: str) -> str:
    text = " ".join(text.split())
    end = re.search(r"(?<!\bal)(?<!e\.g)(?<!i\.e)\.\s+(?=[A-Z`(\"])", text)
    return text if end is None else text[: end.start() + 1]


def common_fields_markdown() -> str:
    """The README's table of the fields most users set: default and first sentence of each field's help, from the
    classes that `scripts/train.py` parses (`ScriptArguments`, `KLPPOConfig`, TRL's `ModelConfig`)."""
    from trl import ModelConfig

    from .cli import ScriptArguments

    lines = ["| field | default | what it does |", "| --- | --- | --- |"]
    for name in COMMON_FIELDS:
        cls = next(c for c in (ScriptArguments, KLPPOConfig, ModelConfig) if name in {f.name for f in fields(c)})
        help_text = {f.name: f for f in fields(cls)}[name].metadata.get("help", "").replace("%%", "%")
        lines.append(f"| `{name}` | {_default(cls, name)} | {_cell(_first_sentence(help_text))} |")
    return "\n".join(lines) + "\n"


def _replace_between(text: str, start: str, end: str, body: str) -> str:
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{body}{end}{tail}"


def built_documents(root: str) -> dict[str, str]:
    """`{path: text}` of the documents whose tables come from the config classes, rebuilt from `root`'s copies."""
    out = {}
    for rel, start, end, body in (
        ("docs/configuration.md", CONFIG_TABLES_START, CONFIG_TABLES_END, configuration_markdown()),
        ("README.md", COMMON_TABLE_START, COMMON_TABLE_END, common_fields_markdown()),
    ):
        path = os.path.join(root, rel)
        with open(path, encoding="utf-8") as f:
            out[path] = _replace_between(f.read(), start, end, body)
    return out


def main(argv=None) -> int:
    """`python -m klppo.config_docs --write` rebuilds the tables of docs/configuration.md and README.md from the
    docstrings; `--check` exits 1 when either is out of date."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--root", default=os.getcwd(), help="the repository root (default: the current folder)")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true")
    mode.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    stale = []
    for path, text in built_documents(args.root).items():
        with open(path, encoding="utf-8") as f:
            current = f.read()
        if current != text:
            stale.append(path)
            if args.write:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(text)
    if args.check and stale:
        print(f"out of date: {', '.join(stale)}; run `python -m klppo.config_docs --write`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
