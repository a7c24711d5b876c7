"""The docs point at what exists: every file and folder the README's layout map names is in the tree, and every
relative link in the README and docs/ reaches a file (and, with an anchor, one of its headings)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    """A heading's anchor as GitHub writes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def layout_rows() -> list[tuple[str, str]]:
    """(path, its description) for each row of the README's layout map."""
    layout = (ROOT / "README.md").read_text().split("## Layout", 1)[1].split("```")[1]
    rows: list[tuple[str, str]] = []
    for line in layout.strip("\n").splitlines():
        if line.startswith(" "):
            rows[-1] = (rows[-1][0], rows[-1][1] + line)
        else:
            path, _, text = line.partition(" ")
            rows.append((path, text))
    return rows


def test_every_path_in_the_readme_layout_map_exists():
    rows = layout_rows()
    assert {"src/nanoinfer/", "tests/", "docs/", "BENCHMARKS.md"} <= {path for path, _ in rows}
    for path, text in rows:
        assert (ROOT / path).exists(), f"the README's layout map names {path}, which is not in the tree"
        folder = ROOT / path if path.endswith("/") else ROOT
        for name in re.findall(r"(?<![\w/.-])(\.?[\w-]+(?:/[\w-]+)*(?:/|\.py|\.md|\.toml|/run))(?=[\s,;:)])", text):
            found = (folder / name).exists() or any(folder.rglob(name.rstrip("/")))
            assert found, f"the README's layout map names {name} under {path}, which is not there"


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: path.name)
def test_every_relative_link_reaches_a_file_and_its_heading(doc):
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if target.startswith(("http://", "https://")) or target.endswith(".png"):
            continue
        file, _, anchor = target.partition("#")
        linked = (doc.parent / file).resolve() if file else doc
        assert linked.is_file(), f"{doc.name} links to {target}, which is not a file"
        if anchor:
            headings = {slug(h) for h in re.findall(r"^#+ (.+)$", linked.read_text(), re.M)}
            assert anchor in headings, f"{doc.name} links to {target}, whose file has no such heading"
