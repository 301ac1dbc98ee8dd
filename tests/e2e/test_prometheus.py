"""Metrics through a real Prometheus: the shipped scrape config, the shipped dashboard's queries.

Debian's ``prometheus`` is started on loopback with ``deploy/prometheus/prometheus.yml`` (target
pointed at the test server's port, scrape interval shortened); load goes through ``carpool
serve``'s API with the real ``openai`` client; then every PromQL expression of
``grafana/carpool.json`` must evaluate without error and return data, counters must equal what
was sent, and gauges must be back to idle.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from cluster.config import ServeConfig
from replica.config.engine_config import EngineConfig
from tests.e2e.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


@pytest.fixture(scope="module")
def served(deploy, smollm2_path):
    config = ServeConfig(
        app_name="metrics",
        engine=EngineConfig(model=smollm2_path, dtype="auto", max_num_seqs=4, kv_cache_memory=64 << 20, compile=False),
        served_model_name="smollm2",
    )
    with deploy(config, replicas=2) as served:
        yield served


@pytest.fixture(scope="module")
def prometheus(served, tmp_path_factory):
    """A Prometheus server scraping the test app every 2 s; yields its base URL."""
    assert Path(PROMETHEUS).exists(), "Debian's prometheus is not installed (make test installs it)"
    folder = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "2s"
    config["global"]["scrape_timeout"] = "2s"
    job = config["scrape_configs"][0]
    job["static_configs"][0]["targets"] = [served.root_url.removeprefix("http://")]
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    process = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={folder / 'prometheus.yml'}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _poll(lambda: httpx.get(f"{url}/-/ready", timeout=2).status_code == 200, 30, "prometheus ready")
        yield url
    finally:
        process.terminate()
        process.wait(10)


def _poll(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except (httpx.HTTPError, KeyError, IndexError, ValueError, AssertionError) as exc:
            last = exc
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}: {last!r}")


def query(url: str, expr: str) -> list[dict]:
    response = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
    body = response.json()
    assert response.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]["result"]


def scalar(url: str, expr: str) -> float:
    result = query(url, expr)
    assert len(result) == 1, (expr, result)
    return float(result[0]["value"][1])


def dashboard_exprs() -> list[tuple[str, str]]:
    dashboard = json.loads((ROOT / "grafana/carpool.json").read_text())
    out = []
    for panel in dashboard["panels"]:
        if panel.get("type") == "row" and panel["title"] == "Autoscaling":
            break  # the autoscaling row needs an autoscaled app: tests/e2e/test_autoscaling.py reads it
        for target in panel.get("targets", ()):  # a row has none
            expr = (
                target["expr"]
                .replace("$__rate_interval", "1m")
                .replace("$model", ".*")
                .replace("$replica", ".*")
            )
            out.append((panel["title"], expr))
    variables = dashboard["templating"]["list"]
    assert {v["name"] for v in variables} == {"datasource", "model", "replica"}
    return out


def test_metrics_endpoint_lists_every_replica(served):
    """One scrape holds both replicas' series under one ``# TYPE`` each. A scrape may leave the
    replicas out when they do not all answer within 5 s (the ingress's handle starts on its first
    call; CI's 2 cores are shared), so scrapes are retried for up to 60 s; each must answer 200."""
    replicas = {s["replica"] for s in served.stats()}
    assert len(replicas) == 2
    expected = [f'carpool:num_slots{{model_name="smollm2",replica="{replica}"}} 4.0' for replica in replicas]
    deadline = time.monotonic() + 60
    while True:
        response = httpx.get(f"{served.root_url}/metrics", timeout=30)
        assert response.status_code == 200, response.text
        text = response.text
        if all(line in text for line in expected) or time.monotonic() > deadline:
            break
        time.sleep(1)
    for line in expected:
        assert line in text
    assert text.count("# TYPE carpool:num_requests_running gauge") == 1
    assert 'carpool:http_requests_rejected_total{' in text  # the ingress's own series


def test_prometheus_counters_gauges_and_dashboard(served, prometheus):
    client = served.client
    completions, streamed = [], []
    for i in range(4):
        completions.append(
            client.completions.create(
                model=served.model, prompt=f"Count to {i + 3}:", max_tokens=6 + i, temperature=0,
                extra_body={"ignore_eos": True},
            )
        )
    for i in range(2):
        chunks = list(
            client.chat.completions.create(
                model=served.model, messages=[{"role": "user", "content": f"Say hi {i}"}], max_tokens=5,
                temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )
        )
        streamed.append(chunks[-1].usage)
    usages = [c.usage for c in completions] + streamed
    sent = len(usages)
    prompt_tokens = sum(u.prompt_tokens for u in usages)
    generated = sum(u.completion_tokens for u in usages)
    served.wait_idle()

    # Wait for a scrape that saw the whole load, then compare exactly.
    _poll(
        lambda: scalar(prometheus, 'sum(carpool:request_success_total{finished_reason="length"})') == sent,
        60,
        f"{sent} finished requests in prometheus",
    )
    assert scalar(prometheus, 'sum(carpool:request_success_total{finished_reason="stop"})') == 0
    assert scalar(prometheus, 'sum(carpool:request_success_total{finished_reason="abort"})') == 0
    assert scalar(prometheus, "sum(carpool:prompt_tokens_total)") == prompt_tokens
    assert scalar(prometheus, "sum(carpool:generation_tokens_total)") == generated
    assert scalar(prometheus, "sum(carpool:time_to_first_token_seconds_count)") == sent
    assert scalar(prometheus, "sum(carpool:inter_token_latency_seconds_count)") == generated - sent
    assert scalar(prometheus, "sum(carpool:e2e_request_latency_seconds_count)") == sent
    assert len(query(prometheus, "carpool:num_slots")) == 2
    # Every request was looked up in the prefix cache (its prompt tokens, counted at admission);
    # hits as the replicas count them (the chat requests share the template's system prompt).
    assert scalar(prometheus, "sum(carpool:prefix_cache_queries_total)") == prompt_tokens
    assert scalar(prometheus, "sum(carpool:prefix_cache_hits_total)") == sum(s["prefix_cache_hits"] for s in served.stats())
    # Gauges back to idle on every replica.
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "slot_utilization"):
        assert scalar(prometheus, f"max(carpool:{gauge})") == 0, gauge
    # LoRA is off: its series exist at 0, and no per-adapter series (tests/e2e/test_lora_serve.py has them).
    assert scalar(prometheus, "sum(carpool:lora_adapter_loads_total)") == 0
    assert scalar(prometheus, "max(carpool:lora_adapters_loaded)") == 0
    assert query(prometheus, "carpool:lora_requests_running") == []

    # Every dashboard query evaluates and returns data. rate() needs two scrapes inside its window,
    # which a loaded machine may delay (a slow scrape is dropped), so each query gets some time.
    failures = []
    for title, expr in dashboard_exprs():
        try:
            _poll(lambda: query(prometheus, expr), 30, f"data for {expr}")
        except AssertionError as exc:
            failures.append(f"{title}: {exc}")
    assert not failures, "\n".join(failures)
