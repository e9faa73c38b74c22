"""The README and docs/ hold together: every link and picture points at a file that exists, every docs
page is reachable from the README, and the pictures stay small enough to commit (scripts/docs_images.py)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# [text](target) and ![alt](target) in Markdown; src="target" in the HTML the README uses for pictures side by side
LINK = re.compile(r"\]\(([^)\s]+)\)|<img[^>]*\ssrc=\"([^\"]+)\"")


def local_targets(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
    targets = [a or b for a, b in LINK.findall(text)]
    return [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_and_picture_points_at_a_file(page):
    missing = [t for t in local_targets(page) if not (page.parent / t).exists()]
    assert missing == [], f"{page.relative_to(ROOT)} links to files that do not exist: {missing}"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / t).resolve() for t in local_targets(ROOT / "README.md")}
    assert [p.name for p in PAGES[1:] if p.resolve() not in linked] == []


def test_the_readme_shows_its_pictures_and_they_are_small():
    pictures = [t for t in local_targets(ROOT / "README.md") if t.endswith(".png")]
    assert {"docs/img/stage_graph.png", "docs/img/samples_grid.png", "docs/img/grad_heatmap.png"} <= set(pictures)
    for png in (ROOT / "docs/img").glob("*.png"):
        assert png.stat().st_size < 100_000, f"{png.name}: rerun scripts/docs_images.py, which keeps them small"
