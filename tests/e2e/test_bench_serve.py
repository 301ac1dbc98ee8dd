"""``carpool bench serve`` against a live test server: every request is reported, exact output
lengths (ignore_eos), ordered percentiles, the documented JSON fields."""

from __future__ import annotations

import json

import pytest

from cluster.bench.serve import serve_main
from cluster.config import ServeConfig
from replica.config import EngineConfig

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
        engine=EngineConfig(model=smollm2_path, dtype="bfloat16", max_num_seqs=4, kv_cache_memory=64 << 20),
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
