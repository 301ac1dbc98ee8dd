"""The docs hold together: every relative link and image in README.md and docs/**/*.md points at a
file that exists and, for a ``#anchor``, at a heading that produces that anchor (GitHub's rule);
README.md stays a short front door.

Pure Python and no imports from the project: it reads Markdown files only.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_README_LINES = 250

# [text](target) and ![alt](target), with an optional "title"; text may hold one level of [...]
# (an image inside a link). Reference-style definitions: "[label]: target".
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)
HTML_LINK = re.compile(r"<(?:a|img)\s[^>]*?(?:href|src)=\"([^\"]+)\"", re.IGNORECASE)
FENCE = re.compile(r"^\s{0,3}(```|~~~)")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def markdown_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks, where Markdown is Markdown."""
    lines, fence = [], None
    for number, line in enumerate(text.splitlines(), start=1):
        match = FENCE.match(line)
        if match and (fence is None or match.group(1) == fence):
            fence = match.group(1) if fence is None else None
        elif fence is None:
            lines.append((number, line))
    return lines


def without_code_spans(line: str) -> str:
    return re.sub(r"(`+).*?\1", "", line)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the text without Markdown (code marks, emphasis, links),
    lowercased, punctuation dropped (letters, digits, '-', '_' and spaces kept), spaces as '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").replace("*", "")
    text = text.lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@lru_cache(maxsize=None)
def anchors(path: Path) -> frozenset[str]:
    """Every anchor the headings of a Markdown file produce (repeats get -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    result = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if match:
            base = slug(match.group(2))
            repeats = seen.get(base, 0)
            result.add(base if repeats == 0 else f"{base}-{repeats}")
            seen[base] = repeats + 1
    return frozenset(result)


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link and image in a Markdown file, outside code."""
    found = []
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        line = without_code_spans(line)
        for pattern in (INLINE_LINK, HTML_LINK, REFERENCE_DEF):
            found += [(number, m.group(1)) for m in pattern.finditer(line)]
    return found


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with the relative links of one Markdown file, one line per broken link."""
    problems = []
    for number, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        file_part = unquote(file_part)
        where = f"{path.relative_to(root)}:{number}: {target}"
        if file_part.startswith("/"):
            resolved = root / file_part.lstrip("/")
        elif file_part:
            resolved = path.parent / file_part
        else:
            resolved = path  # "#anchor": a heading of this file
        if not resolved.exists():
            problems.append(f"{where}: no such file")
            continue
        if anchor and resolved.is_file() and resolved.suffix == ".md" and unquote(anchor) not in anchors(resolved):
            problems.append(f"{where}: no heading gives #{anchor}")
    return problems


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    assert links(path) or path != README, "README.md should link to the docs"
    problems = broken_links(path)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_readme_is_a_short_front_door():
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move detail into docs/"


def test_every_doc_is_linked_from_the_readme():
    linked = {
        (README.parent / target.partition("#")[0]).resolve()
        for _, target in links(README)
        if not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE)
    }
    top_level_docs = set((ROOT / "docs").glob("*.md"))
    assert {p.resolve() for p in top_level_docs} - linked == set()


def test_the_checker_finds_broken_links(tmp_path):
    """The checker itself: a missing file, a missing anchor and a missing image are reported;
    external links, links inside code and good anchors are not."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text(
        "# A page\n\n## `carpool serve` options, in short\n\n## Repeat\n\n## Repeat\n",
        encoding="utf-8",
    )
    page = docs / "b.md"
    page.write_text(
        "# B\n\n"
        "[ok](a.md) [ok](a.md#carpool-serve-options-in-short) [ok](a.md#repeat-1) [ok](#b)\n"
        "[ext](https://example.com/missing.md) `[code](missing.md)`\n"
        "```\n[fenced](missing.md)\n```\n"
        "[bad file](missing.md) [bad anchor](a.md#nowhere) ![bad image](img/none.png)\n",
        encoding="utf-8",
    )
    problems = broken_links(page, root=tmp_path)
    assert [p.split(": ")[1] for p in problems] == ["missing.md", "a.md#nowhere", "img/none.png"], problems
