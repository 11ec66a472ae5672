"""The documentation's links: every relative link of the README, docs/ and the notebooks' text points at a file of
the repository, and every ``#anchor`` at a heading of that file (GitHub's anchors)."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").rglob("*.ipynb"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _text(path: Path) -> str:
    if path.suffix == ".ipynb":
        cells = nbformat.read(path, as_version=4).cells
        return "\n".join(cell.source for cell in cells if cell.cell_type == "markdown")
    return path.read_text()


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, anything but letters, digits, spaces, '-' and '_' dropped, spaces to '-'
    (a repeated heading's later anchors get -1, -2, ... suffixes, which no page links to)."""
    headings = re.findall(r"^#+ (.+)$", _text(path), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def test_the_pages_are_found():
    names = {path.name for path in PAGES}
    assert {"README.md", "concepts.md", "api.md", "planner.md", "performance.md", "troubleshooting.md"} <= names
    assert {"transports.md", "02_sft_with_odc.ipynb"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    for link in LINK.findall(_text(page)):
        if re.match(r"[a-z]+:", link):
            continue  # http(s), mailto: not checked offline
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        assert path.is_file(), f"{page.name}: {link} points at no file"
        if anchor:
            assert anchor in _anchors(path), f"{page.name}: {link} points at no heading of {path.name}"
