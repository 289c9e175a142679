"""The README is the way in: short, linked to DEVELOPERS.md and every page of docs/, every relative link resolves,
and only its performance table names a commit."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", REPO / "DEVELOPERS.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
#: A commit hash: 7 to 40 hex digits, letters and digits both.
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for the page's headings."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {(REPO / target).resolve() for target in LINK.findall((REPO / "README.md").read_text())}
    assert {p.resolve() for p in PAGES[1:]} <= linked


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    for target in LINK.findall(page.read_text()):
        if "://" in target:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.name}: {target} does not exist"
        if anchor and file.suffix == ".md":
            assert anchor in _anchors(file), f"{page.name}: {target} names no heading of {file.name}"


def test_the_readme_and_the_benchmarks_page_stay_short() -> None:
    readme = (REPO / "README.md").read_text().splitlines()
    benchmarks = (REPO / "docs" / "benchmarks.md").read_text().splitlines()
    assert len(readme) <= 110, f"README.md has {len(readme)} lines; keep it to 110 and move the rest to docs/"
    assert len(benchmarks) <= 250, f"docs/benchmarks.md has {len(benchmarks)} lines; keep it to 250"


def test_the_readme_names_a_commit_only_under_its_performance_table() -> None:
    """The README says what the software does now; only the performance table's caption names the commit its
    figures ran at."""
    lines = (REPO / "README.md").read_text().splitlines()
    start = lines.index("## Performance")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))
    found = [(number, h) for number, line in enumerate(lines) for h in COMMIT.findall(line)]
    outside = [f"README.md:{number + 1} names {h}" for number, h in found if not start < number < end]
    assert not outside, f"{outside}: commits belong in docs/benchmarks.md"
    assert len(found) == 1, f"the performance table's caption names one commit; found {found}"
