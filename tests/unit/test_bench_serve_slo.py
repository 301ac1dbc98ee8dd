"""``carpool bench serve`` with latency targets: the headers every request carries, and each
request's outcome (met, missed, shed, failed) from what the client measured."""

from __future__ import annotations

import math

import pytest

from cluster.bench.serving.serve import RequestResult, slo_headers
from cluster.bench.serving.serve_report import format_table, summarize


def test_headers():
    assert slo_headers(None, None, False) == {}
    assert slo_headers(2000, 50.5, True) == {"x-slo-ttft-ms": "2000", "x-slo-tpot-ms": "50.5", "x-slo-shed": "true"}
    with pytest.raises(ValueError, match="--shed needs --slo-ttft-ms"):
        slo_headers(None, 50, True)


def test_outcomes_from_the_client_measurements():
    results = [
        RequestResult(0, 5, ok=True, ttft_s=1.5, e2e_s=1.9, output_tokens=5),  # TTFT met, TPOT 100 ms: met
        RequestResult(1, 5, ok=True, ttft_s=2.5, e2e_s=2.9, output_tokens=5),  # TTFT late
        RequestResult(2, 5, ok=True, ttft_s=0.5, e2e_s=2.5, output_tokens=5),  # TPOT 500 ms: late
        RequestResult(3, 5, shed_s=0.02),
        RequestResult(4, 5, shed_s=0.04),
        RequestResult(5, 5, error="APIConnectionError: gone"),
    ]
    summary = summarize(
        results, 10.0, url="u", model="m", request_rate=math.inf, workload="seed-mix", seed=0, max_concurrency=None,
        timeout=None, slo={"ttft_ms": 2000.0, "tpot_ms": 200.0, "shed": True},
    )
    slo = summary["slo"]
    assert (slo["met"], slo["missed"], slo["shed"], slo["failed"]) == (1, 2, 2, 1)
    assert slo["shed_ms"]["max"] == pytest.approx(40.0) and slo["shed_ms"]["p50"] == pytest.approx(30.0)
    assert summary["errors"] == 1 and summary["completed"] == 3  # a shed request is not an error
    assert "met: 1  missed: 2  shed: 2  failed: 1" in format_table(summary)
    no_targets = summarize(
        results[:1], 1.0, url="u", model="m", request_rate=1.0, workload="seed-mix", seed=0, max_concurrency=None, timeout=None,
    )
    assert no_targets["slo"] is None and "latency targets" not in format_table(no_targets)
