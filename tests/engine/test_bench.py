"""``carpool bench offline`` on a tiny random model: exact finish steps, JSON fields, plots, workloads.

Step accounting (cluster/bench/engine/runner.py): step ``n`` is the run's ``n``-th non-empty engine step;
a request admitted at step ``s`` with its whole prompt in that step finishes at ``s + max_tokens - 1``
and its seat is taken by a waiting request at step ``s + max_tokens``.
"""

from __future__ import annotations

import json

import pytest

from cluster.bench import offline_main
from cluster.bench.engine.plots import replot
from cluster.bench.workloads.base import SEED_EXAMPLE_FINISH_STEPS, coefficient_of_variation, read_jsonl, sweep_lengths

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = dict(dtype="float32", kv_cache_memory=16 << 20, progress=False)


def _by_policy(summary: dict) -> dict[str, dict]:
    return {r["policy"]: r for r in summary["results"]}


def _check_run_consistency(run: dict, requests: list[tuple[str, int]]) -> None:
    """Documented fields present; numbers agree with each other and with the workload."""
    for key in ("policy", "output_tokens_per_s", "wall_s", "num_steps", "requests", "latency_s", "vs_carpool"):
        assert key in run, key
    assert [(q["id"], q["output_tokens"]) for q in run["requests"]] == requests
    for q in run["requests"]:
        assert set(q) >= {"id", "output_tokens", "finish_step", "latency_s"}
        assert 0 < q["latency_s"] <= run["wall_s"] + 1e-6
    assert run["output_tokens"] == sum(q["output_tokens"] for q in run["requests"])
    assert run["output_tokens_per_s"] == pytest.approx(run["output_tokens"] / run["wall_s"])
    lat = run["latency_s"]
    assert min(q["latency_s"] for q in run["requests"]) <= lat["p50"] <= lat["p90"] <= lat["p99"]
    assert lat["p99"] == pytest.approx(max(q["latency_s"] for q in run["requests"]))


@pytest.fixture(scope="module")
def seed_example(tiny_llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench")
    summary = offline_main(
        "seed-example", model=tiny_llama, json_path=folder / "seed.json", plot_path=folder / "seed", **SMALL
    )
    return summary, folder


def test_seed_example_finish_steps_are_the_articles(seed_example):
    summary, _ = seed_example
    runs = _by_policy(summary)
    for policy in ("continuous", "static"):
        got = {q["id"]: q["finish_step"] for q in runs[policy]["requests"]}
        assert got == SEED_EXAMPLE_FINISH_STEPS[policy], policy
    assert runs["continuous"]["requests"][4]["finish_step"] == 50  # E slots in when B leaves
    assert runs["static"]["requests"][4]["finish_step"] == 230  # E waits for D
    assert summary["matches_article"] is True
    assert runs["continuous"]["num_steps"] == 200 and runs["static"]["num_steps"] == 230
    assert summary["step_speedup"] == pytest.approx(230 / 200)


def test_seed_example_occupancy_is_the_articles_timeline(seed_example):
    summary, _ = seed_example
    runs = _by_policy(summary)
    cont = {(s["id"], s["padding"]): s for s in runs["continuous"]["occupancy"]}
    assert len(cont) == 5 and not any(padding for _, padding in cont)
    assert (cont[("E", False)]["seat"], cont[("E", False)]["start_step"]) == (cont[("B", False)]["seat"], 21)
    for rid, steps in {"A": (1, 100), "B": (1, 20), "C": (1, 50), "D": (1, 200), "E": (21, 50)}.items():
        assert (cont[(rid, False)]["start_step"], cont[(rid, False)]["end_step"]) == steps
    static = runs["static"]["occupancy"]
    padding = {s["id"]: (s["start_step"], s["end_step"]) for s in static if s["padding"]}
    assert padding == {"A": (101, 200), "B": (21, 200), "C": (51, 200)}  # kept seats until D ends
    (e,) = [s for s in static if s["id"] == "E"]
    assert (e["start_step"], e["end_step"]) == (201, 230)


def test_seed_example_json_and_plots(seed_example):
    summary, folder = seed_example
    data = json.loads((folder / "seed.json").read_text())
    assert data["workload"] == "seed-example" and data["max_num_seqs"] == 4
    runs = _by_policy(data)
    assert set(runs) == {"continuous", "static"}
    article = [("A", 100), ("B", 20), ("C", 50), ("D", 200), ("E", 30)]
    for run in runs.values():
        _check_run_consistency(run, article)
    assert data["speedup"] == pytest.approx(
        runs["continuous"]["output_tokens_per_s"] / runs["static"]["output_tokens_per_s"]
    )
    assert runs["continuous"]["vs_carpool"] == 1.0
    for name in ("seed-occupancy.png", "seed-latency.png"):
        png = (folder / name).read_bytes()
        assert png.startswith(PNG_MAGIC) and 5_000 < len(png) < 500_000, name
    # The JSON holds enough to draw the same plots again without rerunning.
    again = replot(folder / "seed.json", folder / "again")
    assert [p.name for p in again] == ["again-occupancy.png", "again-latency.png"]
    assert all(p.read_bytes().startswith(PNG_MAGIC) for p in again)


def test_seed_mix_small_exact_steps_and_transformers_compare(tiny_llama, tmp_path):
    """6 requests (3 and 12 tokens alternating) on 2 seats, plus both transformers baselines."""
    summary = offline_main(
        "seed-mix", model=tiny_llama, num_requests=6, short=3, long=12, max_num_seqs=2,
        compare=["transformers"], json_path=tmp_path / "mix.json", **SMALL,
    )
    runs = _by_policy(json.loads((tmp_path / "mix.json").read_text()))
    assert list(runs) == ["continuous", "static", "transformers-static", "transformers-continuous"]
    workload = [(str(i), 3 if i % 2 == 0 else 12) for i in range(6)]
    for run in runs.values():
        _check_run_consistency(run, workload)
        assert run["vs_carpool"] == pytest.approx(run["output_tokens_per_s"] / runs["continuous"]["output_tokens_per_s"])
    steps = {p: [q["finish_step"] for q in runs[p]["requests"]] for p in ("continuous", "static", "transformers-static")}
    # continuous: 0 leaves at 3 -> 2 runs 4..6 -> 3 runs 7..18; 1 leaves at 12 -> 4 runs 13..15 -> 5 runs 16..27
    assert steps["continuous"] == [3, 12, 6, 18, 15, 27]
    # static: batches [0,1] steps 1..12, [2,3] 13..24, [4,5] 25..36
    assert steps["static"] == steps["transformers-static"] == [3, 12, 15, 24, 27, 36]
    assert runs["continuous"]["num_steps"] == 27 and runs["static"]["num_steps"] == 36
    assert summary["step_speedup"] == pytest.approx(36 / 27)
    assert summary["speedup"] == pytest.approx(
        runs["continuous"]["output_tokens_per_s"] / runs["static"]["output_tokens_per_s"]
    )


def test_jsonl_workload(tiny_llama, tmp_path):
    path = tmp_path / "traffic.jsonl"
    path.write_text(
        '{"prompt": "Hello there", "max_tokens": 5}\n\n'
        '{"prompt": "Count to ten.", "max_tokens": 9, "id": "count"}\n'
        '{"prompt": [1, 2, 3, 4], "max_tokens": 2}\n'
    )
    assert [(r.id, r.max_tokens) for r in read_jsonl(path)] == [("0", 5), ("count", 9), ("2", 2)]
    summary = offline_main(str(path), model=tiny_llama, max_num_seqs=2, plot_path=tmp_path, **SMALL)
    for run in summary["results"]:
        _check_run_consistency(run, [("0", 5), ("count", 9), ("2", 2)])
    assert (tmp_path / "occupancy.png").read_bytes().startswith(PNG_MAGIC)
    assert (tmp_path / "latency.png").read_bytes().startswith(PNG_MAGIC)


def test_jsonl_errors_name_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok", "max_tokens": 3}\n{"prompt": "", "max_tokens": 3}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: prompt"):
        read_jsonl(bad)
    bad.write_text('{"prompt": "ok", "max_tokens": 0}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: max_tokens"):
        read_jsonl(bad)
    bad.write_text('{"prompt": "a", "max_tokens": 1, "id": "x"}\n{"prompt": "b", "max_tokens": 1, "id": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: id 'x' is used twice"):
        read_jsonl(bad)
    with pytest.raises(ValueError, match="workload"):
        offline_main(str(tmp_path / "missing.jsonl"), progress=False)


def test_sweep_lengths_grow_in_variance_with_the_cap():
    lengths = {cap: sweep_lengths(200, 64, cap, seed=3) for cap in (32, 128, 512)}
    assert lengths[32] == sweep_lengths(200, 64, 32, seed=3)  # reproducible
    assert all(1 <= n <= cap for cap, ns in lengths.items() for n in ns)
    cvs = [coefficient_of_variation(lengths[cap]) for cap in (32, 128, 512)]
    assert cvs[0] < cvs[1] < cvs[2]


def test_sweep_workload(tiny_llama, tmp_path):
    summary = offline_main(
        "sweep", model=tiny_llama, num_requests=6, mean_tokens=6, caps=[4, 16], max_num_seqs=2,
        plot_path=tmp_path / "s.png", **SMALL,
    )
    assert [p["cap"] for p in summary["points"]] == [4, 16]
    assert set(summary["speedup"]) == {"4", "16"}
    for point in summary["points"]:
        lengths = sweep_lengths(6, 6, point["cap"], seed=0)
        for run in point["results"]:
            _check_run_consistency(run, [(str(i), n) for i, n in enumerate(lengths)])
    assert (tmp_path / "s-sweep.png").read_bytes().startswith(PNG_MAGIC)


def test_cli_offline_runs_and_rejects_bad_input(tiny_llama, tmp_path, capsys):
    from cluster.bench import main

    with pytest.raises(SystemExit) as done:
        main(["offline", "-w", "seed-mix", "--model", tiny_llama, "--dtype", "float32", "--num-requests", "2",
              "--short", "2", "--long", "3", "--no-progress", "--json", str(tmp_path / "o.json"),
              "--kv-cache-memory", "16MiB"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "continuous / static speedup" in out
    assert json.loads((tmp_path / "o.json").read_text())["num_requests"] == 2
    with pytest.raises(SystemExit) as done:
        main(["offline", "--kv-cache-memory", "12XB", "--no-progress"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-cache-memory" in err and "12XB" in err  # names the option and the bad value
    with pytest.raises(SystemExit) as done:
        main(["offline", "-w", "nonsense", "--no-progress"])
    assert done.value.code == 2
    assert "workload" in capsys.readouterr().err


def test_profile_reports_each_phase_of_a_step(tiny_llama, tmp_path, capsys):
    """``carpool bench profile``: every phase of the profiled steps is timed, the forward takes the
    most, and the JSON holds what the table printed."""
    from cluster.bench.engine.profile import PHASES, profile_main

    json_path = tmp_path / "profile.json"
    result = profile_main(model=tiny_llama, dtype="float32", max_num_seqs=4, num_requests=8, skip=2, steps=3,
                          json_path=json_path)
    # No constrained request; at TP 1 no step message.
    assert result["running"] == 4 and set(result["phases_ms"]) == set(PHASES) - {"carpool.grammar_masks", "carpool.step_message", "carpool.propose_drafts", "carpool.verify_drafts"}
    assert max(result["phases_ms"], key=result["phases_ms"].get) == "carpool.forward"
    assert result["top_ops_self_ms"] and json.loads(json_path.read_text()) == result
    assert "forward" in capsys.readouterr().out
    with pytest.raises(ValueError, match="ended before"):
        profile_main(model=tiny_llama, dtype="float32", max_num_seqs=4, num_requests=2, skip=0, steps=500)


# ---- carpool bench prefix: prefix caching on vs off ------------------------------------------
def test_shared_prefix_workload_shares_exactly_the_system_turn(smollm2_tokenizer):
    from cluster.bench.workloads import prefix as pw

    requests = pw.shared_prefix(smollm2_tokenizer, 64, system_prompt_len=512, output_len=32)
    again = pw.shared_prefix(smollm2_tokenizer, 64, system_prompt_len=512, output_len=32)
    assert [r.prompt_token_ids for r in requests] == [r.prompt_token_ids for r in again]  # deterministic
    assert len({tuple(r.prompt_token_ids) for r in requests}) == 64 and all(r.max_tokens == 32 for r in requests)
    shared = pw.common_prefix_len(r.prompt_token_ids for r in requests)
    # The system text is at most 512 tokens; the template's turn markers add a few, and every
    # request's user turn starts right after the shared system turn.
    system_ids = smollm2_tokenizer.encode(requests[0].messages[0]["content"], add_special_tokens=False)
    assert 500 <= len(system_ids) <= 512 and len(system_ids) < shared <= len(system_ids) + 16
    for r in requests:
        assert r.prompt_token_ids == pw.render_ids(smollm2_tokenizer, r.messages)  # as the ingress tokenizes
        assert len(r.prompt_token_ids) - shared < 40  # short distinct questions
    assert len(set(pw.user_questions(100))) == 100


def test_multi_turn_next_prompt_is_previous_prompt_output_and_user_turn(smollm2_tokenizer):
    """A turn's ids are the previous prompt, its output, then exactly what the chat template writes
    for one more user turn, so prefixes match token for token."""
    from cluster.bench.workloads import prefix as pw

    tok = smollm2_tokenizer
    first = pw.multi_turn_openings(tok, num_conversations=3, first_turn_len=100, output_len=5)
    assert len({tuple(r.prompt_token_ids[:40]) for r in first}) == 3  # each opens with its own passage
    reply = "Line 3 is closed after ten."
    reply_ids = tok.encode(reply, add_special_tokens=False)
    second = pw.next_turn(tok, first[1], reply_ids)
    assert (second.conversation, second.turn, second.id, second.max_tokens) == (1, 2, "c1t2", 5)
    assert second.prompt_token_ids[: len(first[1].prompt_token_ids) + len(reply_ids)] == first[1].prompt_token_ids + reply_ids
    chat = first[1].messages + [{"role": "assistant", "content": reply}, {"role": "user", "content": pw.follow_up(1, 2)}]
    assert second.prompt_token_ids == pw.render_ids(tok, chat)


def test_prefix_cache_simulator_counts_like_the_engine():
    from cluster.bench.workloads.prefix import simulate_prefix_cache

    a = list(range(40))  # 2 full blocks of 16 and 8 more tokens
    b = list(range(32)) + [99] * 8  # shares a's 2 full blocks
    c = list(range(32))  # exactly a's 2 blocks: the last token is always computed, so 1 block hits
    result = simulate_prefix_cache([(a, a), (b, b), (c, c), ([7] * 20, [7] * 20)])
    assert result["queries"] == 40 + 40 + 32 + 20
    assert result["hits"] == 0 + 32 + 16 + 0
    assert result["hit_rate"] == pytest.approx(48 / 132)


@pytest.fixture(scope="module")
def prefix_bench(tiny_llama, tmp_path_factory, monkeypatch_module):
    """Both workloads, caching on and off, with every multi-turn turn's construction recorded."""
    from cluster.bench.workloads import prefix as pw
    from cluster.bench.engine.prefix import prefix_main

    turns = []
    real_next_turn = pw.next_turn

    def recording_next_turn(tokenizer, previous, output_token_ids, **kwargs):
        following = real_next_turn(tokenizer, previous, output_token_ids, **kwargs)
        turns.append((previous, list(output_token_ids), following))
        return following

    monkeypatch_module.setattr(pw, "next_turn", recording_next_turn)
    path = tmp_path_factory.mktemp("prefix") / "prefix.json"
    summary = prefix_main(
        model=tiny_llama, dtype="float32", kv_cache_memory=16 << 20, max_num_seqs=4, num_requests=6,
        system_prompt_len=64, output_len=4, num_conversations=3, num_turns=3, first_turn_len=40,
        json_path=path, progress=False,
    )
    return summary, json.loads(path.read_text()), turns


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_prefix_bench_json_shape_and_hit_rates(prefix_bench):
    summary, data, _ = prefix_bench
    assert data == json.loads(json.dumps(summary))
    assert data["max_num_seqs"] == 4 and data["output_len"] == 4 and data["settings"] == ["on", "off"]
    assert [w["workload"] for w in data["workloads"]] == ["shared-prefix", "multi-turn"]
    for w in data["workloads"]:
        runs = {r["caching"]: r for r in w["results"]}
        assert set(runs) == {"on", "off"} and set(w["ratios"]) == {"ttft_p50_off_over_on", "ttft_p90_off_over_on", "tok_s_on_over_off"}
        for r in runs.values():
            assert len(r["requests"]) == w["num_requests"] and all(q["output_tokens"] == 4 for q in r["requests"])
            assert r["output_tokens"] == 4 * w["num_requests"]
            assert r["output_tokens_per_s"] == pytest.approx(r["output_tokens"] / r["wall_s"])
            assert r["prompt_tokens"] == sum(q["prompt_tokens"] for q in r["requests"])
            assert all(0 < q["ttft_s"] <= q["latency_s"] for q in r["requests"])
            assert r["ttft_s"]["p50"] <= r["ttft_s"]["p90"]
        on, off = runs["on"], runs["off"]
        assert on["prefix_cache_queries"] >= on["prompt_tokens"]  # every prompt is looked up (preemption may repeat)
        assert 0 < on["hit_rate"] <= on["best_hit_rate"] + 1e-9, w["workload"]
        assert on["prefix_cache_hits"] == sum(q["cached_tokens"] for q in on["requests"])
        assert off["hit_rate"] == 0 and off["prefix_cache_hits"] == 0 and all(q["cached_tokens"] == 0 for q in off["requests"])
        assert w["ratios"]["tok_s_on_over_off"] == pytest.approx(on["output_tokens_per_s"] / off["output_tokens_per_s"])
        assert w["ratios"]["ttft_p50_off_over_on"] == pytest.approx(off["ttft_s"]["p50"] / on["ttft_s"]["p50"])
    shared = data["workloads"][0]
    on = {r["caching"]: r for r in shared["results"]}["on"]
    assert shared["shared_prefix_tokens"] >= 64
    # Every request after the first finds the shared system turn's full blocks cached.
    assert all(q["cached_tokens"] >= shared["shared_prefix_tokens"] // 16 * 16 - 16 for q in on["requests"][1:])


def test_prefix_bench_multi_turn_resends_each_turn_with_its_real_output(prefix_bench, tiny_llama):
    from replica import LLM, SamplingParams

    summary, _, turns = prefix_bench
    mt = summary["workloads"][1]
    runs = {r["caching"]: r for r in mt["results"]}
    for r in runs.values():
        assert sorted((q["conversation"], q["turn"]) for q in r["requests"]) == [(c, t) for c in range(3) for t in (1, 2, 3)]
        for q in r["requests"]:  # closed loop: a turn arrives once the previous one has finished
            if q["turn"] > 1:
                (prev,) = [p for p in r["requests"] if (p["conversation"], p["turn"]) == (q["conversation"], q["turn"] - 1)]
                assert q["arrival_s"] >= prev["arrival_s"] + prev["latency_s"] - 1e-6
                assert q["prompt_tokens"] > prev["prompt_tokens"] + 4
    assert runs["on"]["prompt_tokens"] == runs["off"]["prompt_tokens"]  # caching does not change the outputs
    for r in runs.values():
        assert list(r["ttft_s_by_turn"]) == ["1", "2", "3"]
        first_turns = [q["ttft_s"] for q in r["requests"] if q["turn"] == 1]
        assert r["ttft_s_by_turn"]["1"]["p99"] == pytest.approx(max(first_turns))
    assert len(turns) == 2 * 3 * 2  # two settings x 3 conversations x 2 later turns
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory=16 << 20, max_num_seqs=4)
    for previous, output, following in turns:
        assert len(output) == 4
        assert following.prompt_token_ids[: len(previous.prompt_token_ids) + 4] == previous.prompt_token_ids + output
        # the output is what the model generates for that prompt (greedy)
        [got] = llm.generate(prompt_token_ids=[previous.prompt_token_ids], sampling_params=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert got.outputs[0].token_ids == output


def test_cli_prefix_rejects_bad_input(capsys):
    from cluster.bench import main

    with pytest.raises(SystemExit) as done:
        main(["prefix", "-w", "nonsense", "--no-progress"])
    assert done.value.code == 2
    assert "workload must be one of" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        main(["prefix", "--caching", "maybe", "--no-progress"])
    assert done.value.code == 2
    assert "settings must be among" in capsys.readouterr().err


def test_serve_bench_reads_prefix_cache_counters_per_replica():
    """``carpool bench serve``'s hit rate: the run's deltas of the counters in ``/metrics``,
    summed over the replicas seen in both scrapes."""
    from cluster.bench.serving.serve_prefix import counter_deltas, metrics_url_of, parse_prefix_cache_counters

    def exposition(a_q, a_h, b_q, b_h):
        lines = ["# HELP carpool:prefix_cache_queries_total Tokens looked up.", "# TYPE carpool:prefix_cache_queries_total counter"]
        lines += [f'carpool:prefix_cache_queries_total{{model_name="m",replica="{r}"}} {q}' for r, q in (("a", a_q), ("b", b_q))]
        lines += ["# HELP carpool:prefix_cache_hits_total Tokens found.", "# TYPE carpool:prefix_cache_hits_total counter"]
        lines += [f'carpool:prefix_cache_hits_total{{model_name="m",replica="{r}"}} {h}' for r, h in (("a", a_h), ("b", b_h))]
        lines += ['carpool:num_preemptions_total{model_name="m",replica="a"} 3.0']
        return "\n".join(lines) + "\n"

    before = parse_prefix_cache_counters(exposition(100, 10, 50, 0))
    assert before == {"a": {"queries": 100.0, "hits": 10.0}, "b": {"queries": 50.0, "hits": 0.0}}
    after = parse_prefix_cache_counters(exposition(400, 210, 150, 50))
    deltas = counter_deltas(before, after)
    assert (deltas["queries"], deltas["hits"]) == (400, 250) and deltas["hit_rate"] == pytest.approx(250 / 400)
    assert deltas["replicas"]["a"] == {"queries": 300, "hits": 200, "hit_rate": pytest.approx(2 / 3)}
    assert counter_deltas(None, after) is None and counter_deltas({}, {}) is None
    assert parse_prefix_cache_counters("# nothing here\n") == {}
    assert metrics_url_of("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000/metrics"
