"""``carpool bench offline`` on a tiny random model: exact finish steps, JSON fields, plots, workloads.

Step accounting (cluster/bench/runner.py): step ``n`` is the run's ``n``-th non-empty engine step;
a request admitted at step ``s`` with its whole prompt in that step finishes at ``s + max_tokens - 1``
and its seat is taken by a waiting request at step ``s + max_tokens``.
"""

from __future__ import annotations

import json

import pytest

from cluster.bench import offline_main
from cluster.bench.plots import replot
from cluster.bench.workloads import SEED_EXAMPLE_FINISH_STEPS, coefficient_of_variation, read_jsonl, sweep_lengths

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
    assert "--kv-cache-memory: not a size" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        main(["offline", "-w", "nonsense", "--no-progress"])
    assert done.value.code == 2
    assert "workload" in capsys.readouterr().err


def test_profile_reports_each_phase_of_a_step(tiny_llama, tmp_path, capsys):
    """``carpool bench profile``: every phase of the profiled steps is timed, the forward takes the
    most, and the JSON holds what the table printed."""
    from cluster.bench.profile import PHASES, profile_main

    json_path = tmp_path / "profile.json"
    result = profile_main(model=tiny_llama, dtype="float32", max_num_seqs=4, num_requests=8, skip=2, steps=3,
                          json_path=json_path)
    assert result["running"] == 4 and set(result["phases_ms"]) == set(PHASES)
    assert max(result["phases_ms"], key=result["phases_ms"].get) == "carpool.forward"
    assert result["top_ops_self_ms"] and json.loads(json_path.read_text()) == result
    assert "forward" in capsys.readouterr().out
    with pytest.raises(ValueError, match="ended before"):
        profile_main(model=tiny_llama, dtype="float32", max_num_seqs=4, num_requests=2, skip=0, steps=500)
