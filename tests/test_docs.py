"""The documentation holds together: a short README, every results folder cited, every relative link resolves."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_readme_stays_short():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 350


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
    assert command.startswith("bash scripts/setup.sh && ") and "pytest" in command
    assert command in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
