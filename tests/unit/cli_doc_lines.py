"""The ``carpool serve`` and ``carpool bench ...`` command lines the docs show, and what each one
becomes: the ``ServeConfig`` that ``carpool serve`` would start, or the arguments a bench command
hands its ``*_main`` function (nothing is started or run).

``tests/unit/test_cli_flags.py`` compares them with ``data/cli_doc_outcomes.json``, recorded with the
hand-written CLI before its options were generated from the settings models; ``python -m
tests.unit.cli_doc_lines OUT.json`` records them again.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
COMMAND = re.compile(r"carpool (serve|bench [a-z-]+)\b")
BENCH_MAINS = {  # bench command -> (module, function) its body calls
    "offline": ("cluster.bench.engine.offline", "offline_main"),
    "prefix": ("cluster.bench.engine.prefix", "prefix_main"),
    "serve": ("cluster.bench.serving.serve", "serve_main"),
    "overhead": ("cluster.bench.serving.overhead", "overhead_main"),
    "profile": ("cluster.bench.engine.profile", "profile_main"),
    "spec": ("cluster.bench.engine.spec_bench", "spec_main"),
    "lora": ("cluster.bench.engine.lora_bench", "lora_main"),
    "lora-routing": ("cluster.bench.serving.lora_routing", "lora_routing_main"),
    "autoscale": ("cluster.bench.serving.autoscale", "autoscale_main"),
}


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def doc_command_lines() -> list[str]:
    """Each command line after ``carpool`` as the docs write it (a line's text up to a backtick or
    a table's ``|``; a trailing backslash joins the next line), without duplicates, sorted."""
    found = set()
    for path in doc_files():
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            for match in COMMAND.finditer(line):
                text = line[match.start() + len("carpool "):]
                j = i
                while text.rstrip().endswith("\\") and j + 1 < len(lines):
                    j += 1
                    text = text.rstrip()[:-1] + " " + lines[j].strip()
                text = re.split(r"[`|]", text)[0].strip().rstrip('"')
                found.add(text)
    return sorted(found)


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=lambda v: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else str(v)))


def outcome(line: str, monkeypatch) -> dict[str, Any] | None:
    """What one documented command line does: ``{"exit": code, "result": ...}`` (``result``: the
    ServeConfig as JSON, or the bench function's keyword arguments), or None when the line does
    not split into words (an example with an unclosed quote)."""
    import importlib

    from typer.testing import CliRunner

    import cluster.app
    import cluster.cli

    try:
        argv = shlex.split(line, comments=True)
    except ValueError:
        return None
    seen: list[Any] = []
    monkeypatch.setattr(cluster.cli, "serve_forever", lambda cfg: seen.append(cfg.model_dump(mode="json")))
    monkeypatch.setattr(cluster.app, "listen_problem", lambda host, port: None)
    for module, function in BENCH_MAINS.values():

        def capture(*args, **kwargs):
            seen.append({"args": list(args), **kwargs})
            return {"errors": 0, "runs": {}}

        monkeypatch.setattr(importlib.import_module(module), function, capture)
    result = CliRunner().invoke(cluster.cli.app, argv, env={"CARPOOL_API_KEY": None})
    return {"exit": result.exit_code, "result": _jsonable(seen[0]) if seen else None}


def record(out: Path) -> None:
    """Write every documented line's outcome to ``out`` (JSON)."""
    import pytest

    outcomes = {}
    with pytest.MonkeyPatch.context() as monkeypatch:
        for line in doc_command_lines():
            outcomes[line] = outcome(line, monkeypatch)
    out.write_text(json.dumps(outcomes, indent=1, sort_keys=True) + "\n")
    print(f"{len(outcomes)} lines, {sum(1 for o in outcomes.values() if o and o['exit'] == 0)} accepted")


if __name__ == "__main__":
    record(Path(sys.argv[1]))
