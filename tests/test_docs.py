"""The documentation holds together: every command it shows names a script or module that exists and runs from the
repository root, every results folder is cited, every relative link resolves."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
# where commands are shown: the documents, the results' READMEs (their summary.md files record past invocations
# as they ran), the configs' comments and the lab's docstrings and scripts
COMMAND_SOURCES = [
    *DOCS,
    *sorted((ROOT / "results").glob("*/README.md")),
    *sorted((ROOT / "configs").glob("*.yaml")),
    *sorted((ROOT / "lab").rglob("*.yaml")),
    *sorted((ROOT / "lab").rglob("*.py")),
    *sorted((ROOT / "lab").rglob("*.sh")),
    *sorted((ROOT / "scripts").glob("*.py")),
]
SCRIPT = re.compile(r"\b(?:python3?|bash)\s+((?:[\w.-]+/)+[\w.-]+\.(?:py|sh))\b")
MODULE = re.compile(r"\bpython3?\s+-m\s+((?:klppo|lab)(?:\.\w+)+)")
CONFIG = re.compile(r"--config(?:_file)?\s+((?:[\w.-]+/)+[\w.-]+\.yaml)\b")


def commands_in(path: Path) -> str:
    """The text of `path` with line breaks (and a shell's or a docstring's line continuations) as spaces, so that a
    command split over lines reads whole."""
    return re.sub(r"\s*\\{1,2}\n\s*|\s*\n\s*", " ", path.read_text(encoding="utf-8"))


def module_exists(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__main__.py").is_file()


def test_every_command_shown_names_what_exists_from_the_repository_root():
    """`python path/x.py`, `bash path/x.sh`, `python -m lab.x` / `klppo.x` and `--config path.yaml` name files of
    the repository, relative to its root; no command needs a PYTHONPATH of its own."""
    missing, found = [], 0
    for path in COMMAND_SOURCES:
        text = commands_in(path)
        where = path.relative_to(ROOT)
        for script in SCRIPT.findall(text):
            found += 1
            if not (ROOT / script).is_file() and not script.startswith(("path/", "my_")):
                missing.append(f"{where}: {script}")
        for module in MODULE.findall(text):
            found += 1
            if not module_exists(module):
                missing.append(f"{where}: python -m {module}")
        for config in CONFIG.findall(text):
            found += 1
            if not (ROOT / config).is_file() and not config.startswith(("path/", "RUNS/", "my_")):
                missing.append(f"{where}: --config {config}")
        if "PYTHONPATH=" in text:
            missing.append(f"{where}: a command sets PYTHONPATH")
    assert found > 30, "the patterns no longer find the commands"
    assert not missing, missing


def test_every_results_folder_is_cited():
    text = "\n".join(path.read_text(encoding="utf-8") for path in DOCS)
    folders = sorted(p.name for p in (ROOT / "results").iterdir() if p.is_dir())
    assert folders, "results/ is empty"
    uncited = [name for name in folders if not re.search(rf"results/{re.escape(name)}\b", text)]
    assert not uncited, f"results folders cited nowhere in README.md or docs/: {uncited}"


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", path.read_text(encoding="utf-8"), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_relative_links_and_their_anchors_resolve():
    broken = []
    for path in DOCS:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", path.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            linked = (path.parent / target).resolve() if target else path
            if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in anchors(linked)):
                broken.append(f"{path.relative_to(ROOT)}: {target}#{anchor}")
    assert not broken, broken


def test_the_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    command = readme.split("Run the tests:", 1)[1].split("```bash\n", 1)[1].split("\n", 1)[0]
    assert command.startswith("bash scripts/setup.sh && ") and "-m pytest" in command
    # the lint and the format check come before the tests
    assert (
        command.index(".venv/bin/ruff check .")
        < command.index(".venv/bin/ruff format --check .")
        < command.index("-m pytest")
    )
    assert "ATEN_CPU_CAPABILITY=default" in command and "-m numerics" in command  # the second kernel set
    assert command in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
