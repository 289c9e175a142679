"""The README is the way in: DEVELOPERS.md and every page of docs/ are linked from it, and every relative link
resolves."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", REPO / "DEVELOPERS.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


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
