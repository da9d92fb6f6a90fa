"""Every relative markdown link in README.md and docs/ leads to a file that exists,
and to a heading of it where the link names one: docs move (docs/perf was
reorganised by topic) and a link left behind fails here rather than for a reader."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[3]  # tests/unit/project/ -> the repository
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:


def prose_lines(page: Path) -> list[str]:
    """The page's lines, those inside fenced code blocks blanked (a link in code is an example)."""
    lines, in_fence = [], False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
        lines.append("" if in_fence or FENCE.match(line) else line)
    return lines


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"[*`]", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors_of(page: Path) -> set[str]:
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for line in prose_lines(page):
        match = HEADING.match(line)
        if match:
            anchor = github_anchor(match.group(1))
            count = seen.get(anchor, 0)
            seen[anchor] = count + 1
            anchors.add(anchor if count == 0 else f"{anchor}-{count}")
    return anchors


def broken_links(page: Path) -> list[str]:
    broken = []
    for number, line in enumerate(prose_lines(page), 1):
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            if EXTERNAL.match(target):
                continue
            path_part, _, anchor = target.partition("#")
            linked = (page.parent / unquote(path_part)).resolve() if path_part else page
            if not linked.exists():
                broken.append(f"line {number}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and unquote(anchor).lower() not in anchors_of(linked):
                broken.append(f"line {number}: {target} (no such heading)")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    assert broken_links(page) == []


def test_the_anchor_rule_is_githubs() -> None:
    assert github_anchor("Exact int8 kernels (2026-11-24)") == "exact-int8-kernels-2026-11-24"
    assert github_anchor("`stoker:cost_per_million_tokens` against `x`") == "stokercost_per_million_tokens-against-x"
    assert github_anchor("Exact kernels on every SIMD path, a lone row on 1 x 8") == (
        "exact-kernels-on-every-simd-path-a-lone-row-on-1-x-8"
    )
