"""``carpool bench serve`` against a live test server: every request is reported, exact output
lengths (ignore_eos), ordered percentiles, the documented JSON fields."""

from __future__ import annotations

import json

import pytest

from cluster.bench.serving.serve import serve_main
from cluster.config import ServeConfig
from replica.config.engine_config import EngineConfig

NUM_PROMPTS = 8
SHORT, LONG = 4, 12
SUMMARY_FIELDS = {
    "url", "model", "num_prompts", "request_rate", "workload", "seed", "max_concurrency", "timeout_s",
    "duration_s", "completed", "errors", "error_messages", "requested_output_tokens", "output_tokens",
    "requests_per_s", "output_tokens_per_s", "ttft_ms", "itl_ms", "e2e_ms", "requests",
}


@pytest.fixture(scope="module")
def served(deploy, smollm2_path):
    config = ServeConfig(
        app_name="e2e-bench-serve",
        engine=EngineConfig(model=smollm2_path, dtype="auto", max_num_seqs=4, kv_cache_memory=64 << 20, compile=False),
        served_model_name="smollm2",
    )
    with deploy(config, replicas=1) as served:
        yield served


def test_bench_serve_reports_every_request(served, tmp_path, capsys):
    json_path = tmp_path / "serve.json"
    summary = serve_main(
        served.base_url, json_path=json_path, num_prompts=NUM_PROMPTS, request_rate=20.0, seed=1,
        short=SHORT, long=LONG, timeout=120, progress=False,
    )
    assert summary["model"] == "smollm2"  # the first id of GET /v1/models
    assert summary["completed"] == NUM_PROMPTS and summary["errors"] == 0, summary["error_messages"]
    expected_tokens = (NUM_PROMPTS // 2) * SHORT + (NUM_PROMPTS // 2) * LONG
    assert summary["requested_output_tokens"] == expected_tokens
    assert summary["output_tokens"] == expected_tokens
    assert [r["output_tokens"] for r in summary["requests"]] == [SHORT, LONG] * (NUM_PROMPTS // 2)
    assert summary["requests_per_s"] > 0 and summary["output_tokens_per_s"] > 0
    for key in ("ttft_ms", "itl_ms", "e2e_ms"):
        s = summary[key]
        assert 0 < s["p50"] <= s["p90"] <= s["p99"], (key, s)
        assert s["mean"] > 0
    assert summary["ttft_ms"]["p99"] <= summary["e2e_ms"]["p99"]

    written = json.loads(json_path.read_text())
    assert SUMMARY_FIELDS <= written.keys()
    assert written["completed"] == NUM_PROMPTS and written["request_rate"] == 20.0
    out = capsys.readouterr().out
    assert "TTFT" in out and "ITL" in out and "e2e" in out and "output tok/s" in out


def test_bench_serve_multi_turn_reports_the_prefix_cache_hit_rate(served, tmp_path, capsys):
    """Conversations resend their history: the server's prefix cache hits (read from /metrics),
    and the best possible rate is computed from the prompts as the ingress tokenizes them."""
    conversations, turns, max_tokens = 3, 3, 6
    summary = serve_main(
        served.base_url, json_path=tmp_path / "mt.json", workload="multi-turn", conversations=conversations,
        turns=turns, first_turn_len=64, max_tokens=max_tokens, think_time=0.1, timeout=120, progress=False,
    )
    assert summary["completed"] == conversations * turns and summary["errors"] == 0, summary["error_messages"]
    assert (summary["conversations"], summary["turns"], summary["think_time_s"]) == (conversations, turns, 0.1)
    pairs = sorted((r["conversation"], r["turn"]) for r in summary["requests"])
    assert pairs == [(c, t) for c in range(conversations) for t in range(1, turns + 1)]
    assert all(r["output_tokens"] == max_tokens for r in summary["requests"])
    cache = summary["prefix_cache"]
    assert cache is not None and cache["metrics_url"] == served.root_url + "/metrics"
    assert len(cache["replicas"]) == 1
    # Every prompt was looked up once (the tokenizer the bench simulates with is the ingress's),
    # and later turns found their history cached.
    assert cache["queries"] >= cache["best"]["queries"] > 0
    assert 0 < cache["hit_rate"] and 0 < cache["best"]["hit_rate"] < 1
    assert cache["hits"] <= cache["best"]["hits"] + 16 * conversations * turns
    assert json.loads((tmp_path / "mt.json").read_text())["prefix_cache"]["hits"] == cache["hits"]
    assert "prefix cache: hit rate" in capsys.readouterr().out
