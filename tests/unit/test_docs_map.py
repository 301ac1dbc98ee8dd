"""docs/development.md's package map names every package of replica/, router/ and cluster/, and
nothing else.

The map is the Markdown table under the heading ``### The package map``: one row per package, the
dotted package name in backticks in the first column (``| `replica.core` | concern | may import |``).
Packages are found by walking the three folders for ``__init__.py``, so a new package without a
row fails here, and so does a row for a package that was removed or renamed.

Pure Python and no imports from the project: it reads the file tree and one Markdown file.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "development.md"
TOP_PACKAGES = ("replica", "router", "cluster")
MAP_HEADING = "### The package map"
COLUMNS = 3  # package, its one concern, what it may import

HEADING = re.compile(r"^\s{0,3}#{1,6}\s")
FENCE = re.compile(r"^\s{0,3}(```|~~~)")
DOTTED = r"[a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*"
PACKAGE_CELL = re.compile(rf"^`({DOTTED})`$")
SEPARATOR_CELL = re.compile(r"^:?-{3,}:?$")


def packages(root: Path = ROOT, tops: tuple[str, ...] = TOP_PACKAGES) -> set[str]:
    """Dotted names of every folder under replica/, router/ and cluster/ (themselves included)
    that holds an ``__init__.py``; hidden folders and ``__pycache__`` are skipped."""
    found = set()
    for top in tops:
        for init in (root / top).rglob("__init__.py"):
            parts = init.parent.relative_to(root).parts
            if any(part.startswith(".") or part == "__pycache__" for part in parts):
                continue
            found.add(".".join(parts))
    return found


def cells(row: str) -> list[str]:
    """A table row's cells, stripped (``| a | b |`` → ``["a", "b"]``); a ``|`` inside backticks
    does not split."""
    inner = row.strip()
    inner = inner[1:] if inner.startswith("|") else inner
    inner = inner[:-1] if inner.endswith("|") and not inner.endswith("\\|") else inner
    result, current, in_code = [], "", False
    for char in inner:
        if char == "`":
            in_code = not in_code
        if char == "|" and not in_code:
            result.append(current.strip())
            current = ""
        else:
            current += char
    result.append(current.strip())
    return result


def map_section(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines under the map's heading, up to the next heading."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == MAP_HEADING]
    if len(starts) != 1:
        raise AssertionError(f"expected one {MAP_HEADING!r} heading in {DOC.name}, found {len(starts)}")
    section, fence = [], None
    for i in range(starts[0] + 1, len(lines)):
        line = lines[i]
        match = FENCE.match(line)
        if match and (fence is None or match.group(1) == fence):
            fence = match.group(1) if fence is None else None
        if fence is None and HEADING.match(line):
            break
        section.append((i + 1, line))
    return section


def map_rows(text: str) -> tuple[dict[str, list[str]], list[str]]:
    """The map's rows as {package: cells}, and what is wrong with the table's shape."""
    problems: list[str] = []
    table = [(number, line) for number, line in map_section(text) if line.lstrip().startswith("|")]
    if len(table) < 3:
        return {}, [f"no table with a header, a separator and rows under {MAP_HEADING!r}"]
    numbers = [number for number, _ in table]
    if numbers != list(range(numbers[0], numbers[0] + len(numbers))):
        problems.append(f"the map should be one table (its rows are not contiguous: lines {numbers})")
    header, separator, *body = table
    if len(cells(header[1])) != COLUMNS:
        problems.append(f"line {header[0]}: the header should have {COLUMNS} columns")
    if not all(SEPARATOR_CELL.match(cell) for cell in cells(separator[1])):
        problems.append(f"line {separator[0]}: the second row should be the header's separator")
    rows: dict[str, list[str]] = {}
    for number, line in body:
        row = cells(line)
        match = PACKAGE_CELL.match(row[0])
        if not match:
            problems.append(f"line {number}: the first cell should be a dotted package name in backticks: {row[0]!r}")
            continue
        name = match.group(1)
        if name in rows:
            problems.append(f"line {number}: {name} has a row already")
        if len(row) != COLUMNS or not all(row):
            problems.append(f"line {number}: {name}'s row should have {COLUMNS} non-empty cells")
        rows[name] = row
    return rows, problems


def map_problems(text: str, existing: set[str], root: Path = ROOT, tops: tuple[str, ...] = TOP_PACKAGES) -> list[str]:
    """Everything wrong with the package map against the packages that exist, one line each."""
    project_name = re.compile(rf"`((?:{'|'.join(tops)})(?:\.[a-z_][a-z0-9_]*)*)`")
    rows, problems = map_rows(text)
    problems += [f"{name}: a package with no row in the map" for name in sorted(existing - set(rows))]
    problems += [f"{name}: a row for a package that does not exist" for name in sorted(set(rows) - existing)]
    for name, row in rows.items():
        for cited in project_name.findall(row[-1]):  # what it may import: real packages or modules
            path = root.joinpath(*cited.split("."))
            if cited not in existing and not path.with_suffix(".py").is_file():
                problems.append(f"{name}: may import {cited}, which is neither a package nor a module")
    return problems


def test_the_package_map_names_every_package_and_no_other():
    found = packages()
    assert {"replica", "replica.config", "router.routing", "cluster.bench"} <= found  # the walk works
    problems = map_problems(DOC.read_text(encoding="utf-8"), found)
    assert not problems, f"{DOC.relative_to(ROOT)}, {MAP_HEADING!r}:\n" + "\n".join(problems)


MAP_FOR_THE_CHECKER = """# Dev

## Where things live

`a.c` is named here, outside the map, which does not count.

### The package map

| package | its one concern | may import |
|---|---|---|
| `a` | the top | its packages |
| `a.b` | one thing | `a.gone`, `a.b.mod` |
| `a.x` | a package that is not there | nothing |
| a.b | no backticks | nothing |

### Other files

| package | not the map | |
|---|---|---|
| `a.c` | ignored | nothing |
"""


def test_the_checker_finds_missing_extra_and_malformed_rows(tmp_path):
    for folder in ("a", "a/b", "a/c", "a/data"):  # a/data has no __init__.py: not a package
        (tmp_path / folder).mkdir()
    for package in ("a", "a/b", "a/c"):
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "a" / "b" / "mod.py").write_text("")
    existing = packages(tmp_path, tops=("a",))
    assert existing == {"a", "a.b", "a.c"}
    assert map_problems(MAP_FOR_THE_CHECKER, existing, root=tmp_path, tops=("a",)) == [
        "line 14: the first cell should be a dotted package name in backticks: 'a.b'",
        "a.c: a package with no row in the map",
        "a.x: a row for a package that does not exist",
        "a.b: may import a.gone, which is neither a package nor a module",
    ]
    good = (
        MAP_FOR_THE_CHECKER.replace("| `a.x` | a package that is not there | nothing |\n", "")
        .replace("| a.b | no backticks | nothing |", "| `a.c` | another thing | nothing |")
        .replace("`a.gone`, ", "")
    )
    assert map_problems(good, existing, root=tmp_path, tops=("a",)) == []
    assert map_problems(good.replace("| `a` | the top | its packages |\n", ""), existing, root=tmp_path, tops=("a",)) == [
        "a: a package with no row in the map"
    ]
    assert map_rows("# Dev\n\n### The package map\n\nNo table.\n")[1] != []
