"""The options of ``carpool serve`` and ``carpool bench ...``, generated from the settings models
(``cluster/settings_cli.py``), keep the flags users' scripts give: every flag, alias and
``--x/--no-x`` pair, default, repeatable option and required one of the hand-written CLI
(``data/cli_flags.json``, recorded from it), and every command line the docs show gives what it
gave then (``data/cli_doc_outcomes.json``: the ``ServeConfig`` started, or the bench function's
arguments). Help shows each option's default once, from its field; a bad value is refused by
its field's name.

Changes to the record, each with a ``note`` in its entry: ``serve --scheduling-policy`` keeps its
flag and its default (None, "not given"), but its values are vLLM's ``fcfs|priority`` now (the
field's default: fcfs); its former values ``continuous|static`` still work, deprecated, as the
added ``--batching-policy`` (issue 54, priorities). ``bench autoscale`` adds ``--shape`` (issue 54,
autoscaling that sees waiting; its default is the former load), and its documented line now
gives the bench's new fields and its 1 s queue-wait target. The engine's default seats
(``max_num_seqs``) went from 32 to 64 (issue 54, the burst tail): the documented lines that do not
set them now start engines of 64. ``serve``, ``bench profile`` and ``bench offline`` add
``--quantization/-q`` (vLLM's flag; issue 55, quantized models): their documented lines now give
``quantization: null``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer import _click as click
from typer.main import get_command
from typer.testing import CliRunner

from cluster.cli import app
from tests.unit.cli_doc_lines import doc_command_lines, outcome

DATA = Path(__file__).parent / "data"
BEFORE = json.loads((DATA / "cli_flags.json").read_text())
DOC_OUTCOMES = json.loads((DATA / "cli_doc_outcomes.json").read_text())


def commands() -> dict[str, click.Command]:
    found = {}

    def walk(cmd, path):
        if hasattr(cmd, "commands"):
            ctx = click.Context(cmd)
            for name in cmd.list_commands(ctx):
                walk(cmd.get_command(ctx, name), [*path, name])
        else:
            found[" ".join(path)] = cmd

    walk(get_command(app), [])
    return found


def shape(param) -> dict:
    """What a script depends on: the flags, the default, flag or not, repeatable, required."""
    return {
        "opts": sorted(param.opts), "secondary": sorted(getattr(param, "secondary_opts", [])),
        "default": repr(param.default), "flag": getattr(param, "is_flag", False),
        "multiple": getattr(param, "multiple", None), "required": getattr(param, "required", None),
    }


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_every_command_keeps_its_flags_and_defaults(name):
    now = {tuple(sorted(p.opts)): shape(p) for p in commands()[name].params}
    before = {tuple(p["opts"]): {k: p[k] for k in ("opts", "secondary", "default", "flag", "multiple", "required")}
              for p in BEFORE[name]}
    assert sorted(now) == sorted(before), f"{name}: flags added {set(now) - set(before)}, lost {set(before) - set(now)}"
    changed = {opts: (before[opts], now[opts]) for opts in before if before[opts] != now[opts]}
    assert not changed, changed


def test_no_command_was_added_or_lost():
    assert sorted(commands()) == sorted(BEFORE)


@pytest.mark.parametrize("line", sorted(DOC_OUTCOMES))
def test_documented_command_lines_give_what_they_gave(line, monkeypatch):
    assert outcome(line, monkeypatch) == DOC_OUTCOMES[line]


def test_command_lines_the_docs_show_now_parse(monkeypatch):
    """Lines added to the docs since the record: none ends in a traceback."""
    for line in doc_command_lines():
        if line not in DOC_OUTCOMES:
            result = outcome(line, monkeypatch)
            assert result is None or result["exit"] in (0, 2), (line, result)


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_help_shows_each_default_once(name):
    """An option with a default shows it once, at the end (``[default: 32; x>=1]``), and its
    description does not say it again; every help renders."""
    result = CliRunner().invoke(app, [*name.split(), "--help"], env={"COLUMNS": "100"}, terminal_width=100)
    assert result.exit_code == 0, result.output
    shown = 0
    for param in commands()[name].params:
        text, _, extra = (param.help or "").partition("[default: ")
        if extra:
            shown += 1
            assert "default" not in text.lower(), (param.opts, param.help)
    assert shown >= 3


def test_generated_help_comes_from_the_field():
    from cluster.config import EngineConfig

    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"}, terminal_width=200)
    description = EngineConfig.model_fields["max_num_seqs"].description
    assert f"{description}  [default: 64; x>=1]" in result.output
    result = CliRunner().invoke(app, ["bench", "offline", "--help"], env={"COLUMNS": "200"}, terminal_width=200)
    assert f"{description}  [default: 4; x>=1]" in result.output  # the bench's own default, once


@pytest.mark.parametrize("argv, named", [
    (["serve", "--seats", "0"], "engine.max_num_seqs: Input should be greater than or equal to 1"),
    (["serve", "--seats", "lots"], "engine.max_num_seqs: Input should be a valid integer"),
    (["serve", "--port", "0"], "port: Input should be greater than or equal to 1"),
    (["serve", "--attention-backend", "fast"], "engine.attention_backend: Input should be 'auto', 'reference'"),
    (["serve", "--kv-cache-memory", "lots"], "engine.kv_cache_memory:"),
    (["serve", "--target-seat-utilization", "2", "--autoscale", "1:2"], "autoscaling.target_seat_utilization:"),
    (["serve", "--autoscale", "2"], "autoscale: --autoscale takes MIN:MAX"),
    (["serve", "--dtype", "float7"], "engine: dtype must be one of"),
    (["serve", "--served-model-name", ""], "served_model_name: String should have at least 1 character"),
    (["serve", "--max-request-body-bytes", "lots"], "max_request_body_bytes (--max-request-body-bytes): not a size"),
    (["serve", "--lora-dir", "/no/such/dir"], "lora_dirs (--lora-dir): directory '/no/such/dir' does not exist"),
    (["serve", "--tool-chat-template", "/no/such/file"], "tool_chat_template (--tool-chat-template): file '/no/such/file' does not exist"),
    (["bench", "offline", "--seats", "0"], "max_num_seqs (--max-num-seqs): Input should be greater than or equal to 1"),
    (["bench", "offline", "--dtype", "float8"], "dtype must be one of"),
    (["bench", "offline", "--caps", "1,x"], "caps (--caps): must be comma-separated integers"),
    (["bench", "offline", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'],
     "speculative_config.num_speculative_tokens (--speculative-config): Input should be greater than or equal to 1"),
    (["bench", "offline", "--speculative-config", "[4]"], "engine.speculative_config (--speculative-config): --speculative-config must be a JSON object"),
    (["bench", "prefix", "--think-time", "-1"], "think_time (--think-time): Input should be greater than or equal to 0"),
    (["bench", "serve", "-n", "0"], "num_prompts (--num-prompts): Input should be greater than or equal to 1"),
    (["bench", "spec", "--workloads", "nope"], "workloads (--workloads): unknown workload(s) ['nope']"),
    (["bench", "autoscale", "--policies", "nope"], "policies (--policies): unknown policy(s) ['nope']"),
    (["bench", "lora-routing", "--hot-fraction", "2"], "hot_fraction (--hot-fraction): Input should be less than or equal to 1"),
    (["bench", "lora-routing", "--replicas", "0"], "replicas (--replicas): must be a positive integer or 'auto'"),
    (["bench", "lora", "--threads", "0"], "threads (--threads): Input should be greater than or equal to 1"),
    (["bench", "spec", "--seats", "0"], "seats.0 (--seats): Input should be greater than or equal to 1"),
    (["bench", "spec", "--seats", ","], "seats (--seats): List should have at least 1 item"),
    (["bench", "offline", "--caps", "0"], "caps.0 (--caps): Input should be greater than or equal to 1"),
])
def test_a_bad_value_is_refused_by_its_field(argv, named, monkeypatch):
    import cluster.app
    import cluster.cli

    monkeypatch.setattr(cluster.cli, "serve_forever", lambda cfg: pytest.fail("started"))
    monkeypatch.setattr(cluster.app, "listen_problem", lambda host, port: None)
    result = CliRunner().invoke(app, argv, env={"CARPOOL_API_KEY": None})
    assert result.exit_code == 2 and named in result.output and "Traceback" not in result.output, result.output


def test_each_bench_function_takes_what_its_command_gives():
    """The bench functions' signatures still take the arguments the commands hand them."""
    import importlib
    import inspect

    from tests.unit.cli_doc_lines import BENCH_MAINS

    for line, result in DOC_OUTCOMES.items():
        if line.startswith("bench ") and result and result["result"]:
            module, function = BENCH_MAINS[line.split()[1]]
            kwargs = dict(result["result"])
            inspect.signature(getattr(importlib.import_module(module), function)).bind(*kwargs.pop("args"), **kwargs)


def test_scheduling_policy_takes_vllms_values_and_its_former_ones_with_a_warning(monkeypatch):
    """``--scheduling-policy fcfs|priority`` (vLLM's); ``continuous|static``, its former values,
    still start the server, as ``--batching-policy``, with a deprecation warning."""
    import warnings

    import cluster.app
    import cluster.cli

    started: list = []
    monkeypatch.setattr(cluster.cli, "serve_forever", started.append)
    monkeypatch.setattr(cluster.app, "listen_problem", lambda host, port: None)
    cases = [
        (["--scheduling-policy", "priority"], ("continuous", "priority"), False),
        (["--batching-policy", "static"], ("static", "fcfs"), False),
        (["--scheduling-policy", "static"], ("static", "fcfs"), True),
        (["--scheduling-policy", "continuous"], ("continuous", "fcfs"), True),
    ]
    for argv, policies, deprecated in cases:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = CliRunner().invoke(app, ["serve", *argv], env={"CARPOOL_API_KEY": None})
        assert result.exit_code == 0, result.output
        engine = started.pop().engine
        assert (engine.batching_policy, engine.scheduling_policy) == policies, argv
        assert any("is deprecated" in str(w.message) for w in caught if w.category is FutureWarning) == deprecated, argv
    result = CliRunner().invoke(app, ["serve", "--scheduling-policy", "fifo"], env={"CARPOOL_API_KEY": None})
    assert result.exit_code == 2 and "engine.scheduling_policy: Input should be 'fcfs' or 'priority'" in result.output
