"""``carpool bench offline -w input-grounded --speculative-config ...`` on a tiny random model: the
workload runs with its exact lengths and the summary reports the engine's speculative decoding
counters (for the whole run and for each policy's run). ``carpool bench spec``: both engines run
the same requests, the tokens compare equal, and the step cost by rows is reported."""

from __future__ import annotations

import json

from cluster.bench import offline_main
from cluster.bench.workloads.input_grounded import input_grounded_prompts

SPEC = {"method": "ngram", "num_speculative_tokens": 3}
COUNTERS = {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate", "mean_acceptance_length"}


def test_offline_input_grounded_reports_spec_decode(tiny_llama, tmp_path, capsys):
    summary = offline_main(
        "input-grounded", model=tiny_llama, dtype="float32", kv_cache_memory=16 << 20, progress=False, compile=False,
        num_requests=2, seed=4, speculative_config=SPEC, json_path=tmp_path / "ig.json",
    )
    lengths = [p.max_tokens for p in input_grounded_prompts(2, seed=4)]
    for run in summary["results"]:
        assert [(q["id"], q["output_tokens"]) for q in run["requests"]] == [("0", lengths[0]), ("1", lengths[1])]
        assert COUNTERS <= set(run["spec_decode"]) and run["spec_decode"]["num_drafts"] >= 0
    assert summary["workload"] == "input-grounded"
    assert summary["speculative_config"]["method"] == "ngram" and summary["speculative_config"]["num_speculative_tokens"] == 3
    assert COUNTERS | {"accepted_per_position"} <= set(summary["spec_decode"])
    total = summary["spec_decode"]["num_draft_tokens"]
    assert total >= sum(r["spec_decode"]["num_draft_tokens"] for r in summary["results"])  # runs, plus warm-ups
    assert json.loads((tmp_path / "ig.json").read_text())["spec_decode"] == summary["spec_decode"]
    assert "spec decode, continuous: acceptance" in capsys.readouterr().out


def test_bench_spec_compares_the_same_requests_with_and_without_drafts(tiny_llama, tmp_path, capsys):
    import torch

    from cluster.bench.engine.spec_bench import COST_ROWS, spec_main

    config = {"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 2, "adaptive": False}
    results = spec_main(
        model=tiny_llama, dtype="float32", seats=[2], workloads=["input-grounded", "seed-mix"], num_requests=2,
        threads=torch.get_num_threads(), speculative_config=config, compile=False, json_path=tmp_path / "spec.json",
    )
    assert [(r["workload"], r["seats"]) for r in results["runs"]] == [("input-grounded", 2), ("seed-mix", 2)]
    for run in results["runs"]:
        assert run["same_tokens"] and run["on"]["output_tokens"] == run["off"]["output_tokens"] > 0
        assert run["on"]["acceptance_rate"] == 1.0 and run["off"]["draft_tokens"] == 0  # its own draft: all kept
        assert run["on"]["mean_acceptance_length"] > 1.5 and len(run["tok_s_ratio_by_round"]) == 2
    assert sorted(int(n) for n in json.loads((tmp_path / "spec.json").read_text())["step_cost_ms_by_tokens"]) == list(COST_ROWS)
    assert "seats  2" in capsys.readouterr().out
