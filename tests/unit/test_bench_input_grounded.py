"""The ``input-grounded`` bench workload and the benches' speculative decoding reports, without an
engine: the prompts are deterministic and hold what the answer repeats; ``--speculative-config``
is parsed and checked before anything starts; acceptance is computed from the engine's counters
and from a server's ``/metrics``."""

from __future__ import annotations

import re

import pytest

from cluster.bench.engine import spec_decode as sd
from cluster.bench.workloads import input_grounded as ig


def test_input_grounded_is_deterministic_and_varied():
    first = ig.input_grounded_prompts(30, seed=0)
    assert first == ig.input_grounded_prompts(30, seed=0)  # same seed, same prompts
    assert first != ig.input_grounded_prompts(30, seed=1)
    assert [p.task for p in first[:6]] == list(ig.TASKS) * 2
    assert len({p.prompt for p in first}) >= 20
    low, high = ig.MAX_TOKENS_RANGE
    assert all(low <= p.max_tokens <= high for p in first)
    requests = ig.input_grounded(5, seed=0)
    assert [(r.id, r.prompt, r.max_tokens) for r in requests] == [(str(i), p.prompt, p.max_tokens) for i, p in enumerate(first[:5])]


def test_input_grounded_prompts_hold_the_document_the_answer_repeats():
    for p in ig.input_grounded_prompts(60, seed=3):
        if p.task == "repeat":
            assert p.prompt.endswith(":\n\n" + p.document) and p.expected == p.document
        elif p.task == "rename":
            assert f"```python\n{p.document}\n```" in p.prompt
            old, new = re.search(r"`(\w+)` renamed to `(\w+)`", p.prompt).groups()
            assert re.search(rf"\b{old}\b", p.document) and not re.search(rf"\b{new}\b", p.document)
            assert p.expected == f"```python\n{ig.rename(p.document, old, new)}\n```" and p.expected != f"```python\n{p.document}\n```"
        else:  # fix-typo: the paragraph with one word's two adjacent letters swapped
            assert p.task == "fix-typo" and p.expected == p.document
            shown = p.prompt.split("\n\n", 1)[1]
            words, typo = p.document.split(" "), shown.split(" ")
            diff = [(a, b) for a, b in zip(words, typo) if a != b]
            assert len(words) == len(typo) and len(diff) == 1
            (a, b), = diff
            assert sorted(a) == sorted(b) and sum(x != y for x, y in zip(a, b)) == 2


def test_input_grounded_lengths_with_smollm2(smollm2_tokenizer):
    """Prompts of 150 to 400 tokens with the chat template (as the bench sends them); each answer
    is longer than its max_tokens, so a request ends while the model is still copying."""
    from cluster.bench.workloads.base import tokenize

    prompts = ig.input_grounded_prompts(24, seed=0)
    requests = ig.input_grounded(24, seed=0)
    tokenize(requests, smollm2_tokenizer)
    for p, r in zip(prompts, requests):
        assert 150 <= len(r.prompt_token_ids) <= 400, (p.task, len(r.prompt_token_ids))
        assert len(smollm2_tokenizer.encode(p.expected)) >= ig.MAX_TOKENS_RANGE[1], p.task


def test_workload_is_offered_by_the_benches():
    from cluster.bench.serving.serve import bench_prompts
    from cluster.bench.workloads.base import BUILTIN_WORKLOADS

    assert "input-grounded" in BUILTIN_WORKLOADS
    pairs = bench_prompts("input-grounded", 4, seed=2)
    assert pairs == [(p.prompt, p.max_tokens) for p in ig.input_grounded_prompts(4, seed=2)]
    assert {n for _, n in bench_prompts("input-grounded", 4, max_tokens=7)} == {7}


def test_bench_cli_checks_the_speculative_config_before_anything_starts(monkeypatch, capsys):
    from cluster.bench import main
    from cluster.bench.engine import offline, profile

    seen = {}
    monkeypatch.setattr(offline, "offline_main", lambda workload, **kw: seen.update(workload=workload, **kw))
    monkeypatch.setattr(profile, "profile_main", lambda **kw: seen.update(profile=kw))
    with pytest.raises(SystemExit) as done:
        main(["offline", "-w", "input-grounded", "--num-requests", "4", "--speculative-config",
              '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'])
    assert done.value.code == 0
    assert seen["workload"] == "input-grounded" and seen["num_requests"] == 4
    assert seen["speculative_config"] == {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4, "model": None,
        "adaptive": True,
    }
    with pytest.raises(SystemExit) as done:
        main(["profile", "-w", "input-grounded", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert done.value.code == 0
    assert seen["profile"]["workload"] == "input-grounded" and seen["profile"]["speculative_config"]["num_speculative_tokens"] == 2

    for bad, named in [
        ('{"method": "ngram", "num_speculative_tokens": 3, "lookahead": 2}', "speculative_config.lookahead (--speculative-config): Extra inputs are not permitted"),
        ('{"method": "ngram", "num_speculative_tokens": 99}', "speculative_config.num_speculative_tokens (--speculative-config): Input should be less than or equal to 16"),
        ('{"method": "medusa", "num_speculative_tokens": 2}', "speculative_config.method (--speculative-config): Input should be 'ngram' or 'draft_model'"),
        ('{"num_speculative_tokens": 2}', "speculative_config.method (--speculative-config): Field required"),
        ('{"method": "ngram", num_speculative_tokens: 2}', "--speculative-config is not valid JSON"),
        ('"ngram"', "--speculative-config must be a JSON object"),
    ]:
        seen.clear()
        for command in ("offline", "profile"):
            with pytest.raises(SystemExit) as done:
                main([command, "--speculative-config", bad])
            assert done.value.code == 2 and not seen
            err = capsys.readouterr().err
            assert named in err and "Traceback" not in err, err


def test_acceptance_from_the_engines_counters():
    from replica.engine.stats import SpecDecodeStats

    stats = SpecDecodeStats()
    stats.observe(4, 2)
    before = sd.engine_counters(type("Engine", (), {"spec_decode_stats": stats})())
    stats.observe(4, 4)
    stats.observe(3, 0)
    after = sd.engine_counters(type("Engine", (), {"spec_decode_stats": stats})())
    delta = sd.counters_delta(before, after)
    assert (delta["num_drafts"], delta["num_draft_tokens"], delta["num_accepted_tokens"]) == (2, 7, 4)
    assert delta["accepted_per_position"] == [1, 1, 1, 1]
    assert delta["acceptance_rate"] == pytest.approx(4 / 7) and delta["mean_acceptance_length"] == pytest.approx(3.0)
    assert sd.engine_counters(object()) is None and sd.counters_delta(None, after) is None
    assert "acceptance 57.1% (4 of 7 draft tokens), mean acceptance length 3.00 (2 drafts)" in sd.format_spec_decode(delta)


def test_acceptance_from_a_servers_metrics():
    def exposition(a, b):
        lines = []
        for kind, i in (("num_drafts", 0), ("num_draft_tokens", 1), ("num_accepted_tokens", 2)):
            lines += [f"# HELP carpool:spec_decode_{kind}_total x", f"# TYPE carpool:spec_decode_{kind}_total counter"]
            lines += [f'carpool:spec_decode_{kind}_total{{model_name="m",replica="{r}"}} {v[i]}' for r, v in (("a", a), ("b", b))]
        return "\n".join(lines + ['carpool:num_preemptions_total{model_name="m",replica="a"} 3.0']) + "\n"

    before = exposition((10, 40, 20), (0, 0, 0))
    after = exposition((60, 240, 120), (50, 200, 50))
    run = sd.served_deltas(before, after)
    assert (run["num_drafts"], run["num_draft_tokens"], run["num_accepted_tokens"]) == (100, 400, 150)
    assert run["acceptance_rate"] == pytest.approx(150 / 400) and run["mean_acceptance_length"] == pytest.approx(2.5)
    assert run["replicas"]["a"]["acceptance_rate"] == pytest.approx(0.5)
    assert run["replicas"]["b"]["mean_acceptance_length"] == pytest.approx(2.0)
    plain = 'carpool:num_preemptions_total{model_name="m",replica="a"} 3.0\n'
    assert sd.served_deltas(plain, plain) is None  # a server without the counters
    assert sd.served_deltas(exposition((0, 0, 0), (0, 0, 0)), exposition((0, 0, 0), (0, 0, 0))) is None  # nor drafts
    assert sd.served_deltas(None, after) is None
    idle = sd.served_deltas(before, before)
    assert idle["num_drafts"] == 0 and idle["acceptance_rate"] is None and idle["mean_acceptance_length"] is None


def test_serve_bench_table_reports_acceptance():
    from cluster.bench.serving.serve_report import format_table, summarize

    run = sd.with_rates({"num_drafts": 100, "num_draft_tokens": 400, "num_accepted_tokens": 150})
    summary = summarize([], 1.0, url="u", model="m", request_rate=float("inf"), workload="input-grounded", seed=0,
                        max_concurrency=None, timeout=None, prefix_cache=None, spec_decode=run)
    assert summary["spec_decode"]["acceptance_rate"] == pytest.approx(0.375)
    assert "spec decode: acceptance 37.5% (150 of 400 draft tokens), mean acceptance length 2.50" in format_table(summary)
