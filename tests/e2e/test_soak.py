"""The long run (``make soak``; excluded from ``make test`` by the ``soak`` marker).

5,000 mixed requests against a real served app (2 replicas of the real SmolLM2): short and long,
streamed and not, completions and chat, some cancelled by their client (a stream closed after a
few events or before the first, a non-streaming call abandoned), with a KV pool small enough that
preemption really happens. At the end every replica must be idle with every block free and
``check_integrity()`` passing (the autouse check of ``conftest.py``), no request may have failed,
and each replica's resident memory (RSS of its process) may end at most ``MAX_RSS_GROWTH`` above
where it was before the first request; each replica's and the ingress's, at most
``MAX_RSS_GROWTH_AFTER_WARMUP`` above where it was after a warm-up of ``WARMUP`` requests (the
ingress's first requests load what it uses lazily). The figures are printed (run with ``-s``) and
written to ``$CARPOOL_SOAK_JSON`` when that is set.

Two mixes, one test each: ``mixed`` (random prompts) and ``shared-prefix``, where most prompts start
with one of a few long shared headers, so that the prefix cache hits, shares blocks between running
requests, and evicts cached blocks under the small pool while requests are cancelled and preempted.
At the end every block must be free (cached free blocks count as free).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time

import httpx
import psutil
import pytest

from cluster.config import ServeConfig
from replica.config.engine_config import EngineConfig
from tests.e2e.conftest import cluster_processes
from tests.e2e.test_disconnects import assert_gauges_zero

NUM_REQUESTS = int(os.environ.get("CARPOOL_SOAK_REQUESTS", "5000"))
# RSS is sampled before the first request, after the warm-up and after every CHUNK requests. The
# warm-up's growth (about 4%) is Serve's and the allocator's first use; after it RSS is flat.
# Before steps were padded to a few sizes (replica.kernels.shapes.padded_size), oneDNN built a
# primitive for every new token count and RSS grew by 25% over the 5,000 requests.
WARMUP = 1000
CHUNK = 1000
CONCURRENCY = 48
MAX_RSS_GROWTH = 0.05
MAX_RSS_GROWTH_AFTER_WARMUP = 0.02
# 16 seats but 40 blocks × 16 = 640 tokens of KV per replica: a few long requests fill it.
ENGINE = EngineConfig(dtype="auto", max_num_seqs=16, num_blocks=40, max_model_len=256)
CONFIG = ServeConfig(app_name="e2e-soak", engine=ENGINE)
WORDS = "the sea river light stone cloud winter garden music paper window mountain story city bird".split()
# shared-prefix mix: 6 headers of 60 to 90 words (about 70 to 110 tokens) that most prompts start with.
_header_rng = random.Random(11)
HEADERS = [" ".join(_header_rng.choice(WORDS) for _ in range(_header_rng.randint(60, 90))) for _ in range(6)]

pytestmark = pytest.mark.soak


@pytest.fixture(scope="module")
def served(deploy):
    with deploy(CONFIG, replicas=2) as served:
        yield served


def make_request(rng: random.Random, model: str, shared_prefix: bool = False) -> dict:
    """One request of the mix: ``kind`` (what the client does) and the HTTP body."""
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 50)))
    if shared_prefix and rng.random() < 0.7:
        prompt = rng.choice(HEADERS) + " " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 20)))
    roll = rng.random()
    if roll < 0.10:
        kind, max_tokens = rng.choice(["cancel_stream", "cancel_stream", "cancel_plain"]), 40
    elif roll < 0.25:
        kind, max_tokens = rng.choice(["stream", "plain"]), rng.randint(24, 48)
    else:
        kind, max_tokens = rng.choice(["stream", "plain", "plain"]), rng.randint(1, 4)
    body = {"model": model, "max_tokens": max_tokens, "temperature": rng.choice([0, 0.8]), "ignore_eos": True,
            "stream": kind in ("stream", "cancel_stream")}
    if rng.random() < 0.3:
        return {"kind": kind, "path": "/chat/completions", "body": {**body, "messages": [{"role": "user", "content": prompt}]}}
    return {"kind": kind, "path": "/completions", "body": {**body, "prompt": prompt}, "cut": rng.randint(0, 3)}


async def run_one(client: httpx.AsyncClient, base_url: str, req: dict) -> str:
    """Send one request; returns ``completed``, ``cancelled`` or ``failed: ...``."""
    url = base_url + req["path"]
    kind = req["kind"]
    if kind == "cancel_plain":
        try:
            await asyncio.wait_for(client.post(url, json=req["body"]), timeout=0.3)
        except asyncio.TimeoutError:
            return "cancelled"
        return "completed"  # it was quicker than the client's patience
    if kind == "plain":
        r = await client.post(url, json=req["body"])
        if r.status_code != 200:
            return f"failed: {r.status_code} {r.text[:200]}"
        reason = r.json()["choices"][0]["finish_reason"]
        return "completed" if reason == "length" else f"failed: finish_reason {reason}"
    async with client.stream("POST", url, json=req["body"]) as r:
        if r.status_code != 200:
            return f"failed: {r.status_code}"
        events = 0
        last = None
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if kind == "cancel_stream" and events >= req.get("cut", 1):
                return "cancelled"  # leaving the block closes the connection
            events += 1
            last = line[6:]
        if last != "[DONE]":
            return f"failed: stream ended with {last!r}"
        return "completed"


async def run_mix(base_url: str, requests: list[dict]) -> dict:
    """Send ``requests`` with ``CONCURRENCY`` clients; counts per outcome (and the first failures)."""
    counts: dict = {"failures": []}
    queue: asyncio.Queue = asyncio.Queue()
    for req in requests:
        queue.put_nowait(req)
    limits = httpx.Limits(max_connections=CONCURRENCY * 2, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                req = queue.get_nowait()
                try:
                    outcome = await run_one(client, base_url, req)
                except Exception as exc:
                    outcome = f"failed: {exc!r}"
                key = outcome if outcome in ("completed", "cancelled") else "failed"
                counts[key] = counts.get(key, 0) + 1
                if key == "failed" and len(counts["failures"]) < 5:
                    counts["failures"].append(outcome)

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return counts


def replica_rss(served) -> dict[int, int]:
    """Resident set size (bytes) of each replica process, by pid."""
    return {s["pid"]: psutil.Process(s["pid"]).memory_info().rss for s in served.stats()}


def served_rss(served) -> dict[int, int]:
    """Resident set size (bytes) of each replica process and of the app's ingress process (its
    per-request state: delta queues, connections, streams), by pid. The local Ray cluster is this
    process's child, and Ray titles the ingress ``ray::ServeReplica:<app>:OpenAIIngress``."""
    [ingress] = cluster_processes(os.getpid(), f"ServeReplica:{served.name}:OpenAIIngress")
    return replica_rss(served) | {ingress.pid: ingress.memory_info().rss}


@pytest.mark.timeout(3600)  # on the function: it must win over the e2e conftest's 420 s
@pytest.mark.parametrize("shared_prefix", [False, True], ids=["mixed", "shared-prefix"])
def test_soak(served, shared_prefix):
    rng = random.Random(7)
    warmup = [make_request(rng, served.model, shared_prefix) for _ in range(WARMUP)]
    mix = [make_request(rng, served.model, shared_prefix) for _ in range(NUM_REQUESTS)]
    rss_start = replica_rss(served)
    counts = asyncio.run(run_mix(served.base_url, warmup))
    assert counts.get("failed", 0) == 0, counts
    served.wait_idle(timeout_s=10)
    rss_before = served_rss(served)
    before = served.metrics()

    started = time.monotonic()
    counts: dict = {"failures": []}
    rss_trajectory = []
    for i in range(0, len(mix), CHUNK):
        for key, value in asyncio.run(run_mix(served.base_url, mix[i : i + CHUNK])).items():
            counts[key] = counts.get(key, 0) + value
        served.wait_idle(timeout_s=10)
        rss_trajectory.append([round(v / 2**20, 1) for v in served_rss(served).values()])
    wall = time.monotonic() - started
    stats = served.wait_idle(timeout_s=10)
    rss_after = served_rss(served)
    after = served.metrics()
    delta = {name: after[name] - before.get(name, 0.0) for name in (
        "carpool:requests_aborted_total", "carpool:num_preemptions_total", "carpool:generation_tokens_total",
        "carpool:prefix_cache_queries_total", "carpool:prefix_cache_hits_total")}
    figures = {
        "requests": NUM_REQUESTS,
        "completed": counts.get("completed", 0),
        "cancelled_by_client": counts.get("cancelled", 0),
        "failed": counts.get("failed", 0),
        "aborted_in_engine": int(delta["carpool:requests_aborted_total"]),
        "preemptions": int(delta["carpool:num_preemptions_total"]),
        "generated_tokens": int(delta["carpool:generation_tokens_total"]),
        "prefix_cache_hit_rate": round(delta["carpool:prefix_cache_hits_total"] / max(1.0, delta["carpool:prefix_cache_queries_total"]), 3),
        "cached_blocks_at_end": [s["num_cached_blocks"] for s in stats],
        "blocks_free_at_end": [f"{s['num_free_blocks']}/{s['num_total_blocks']}" for s in stats],
        "rss_mib_before": {pid: round(v / 2**20, 1) for pid, v in rss_before.items()},
        "rss_mib_after": {pid: round(v / 2**20, 1) for pid, v in rss_after.items()},
        f"rss_mib_every_{CHUNK}_requests": rss_trajectory,
        "rss_mib_at_start_of_warmup": {pid: round(v / 2**20, 1) for pid, v in rss_start.items()},
        "ingress_pid": next(iter(set(rss_after) - set(rss_start))),
        "wall_s": round(wall, 1),
        "warmup_requests": WARMUP,
    }
    print("\nsoak:", json.dumps(figures, indent=1))
    if os.environ.get("CARPOOL_SOAK_JSON"):
        with open(os.environ["CARPOOL_SOAK_JSON"], "w") as f:
            json.dump(figures, f, indent=1)

    assert counts.get("failed", 0) == 0, counts
    assert figures["completed"] + figures["cancelled_by_client"] == NUM_REQUESTS
    assert figures["cancelled_by_client"] > 0 and 0 < figures["aborted_in_engine"] <= figures["cancelled_by_client"]
    assert figures["preemptions"] > 0
    if shared_prefix:
        assert figures["prefix_cache_hit_rate"] > 0.3, figures["prefix_cache_hit_rate"]
    assert all(s["num_free_blocks"] == s["num_total_blocks"] for s in stats)
    assert set(rss_after) == set(rss_before), "a replica or the ingress was restarted during the soak"
    for pid, rss in rss_start.items():
        assert rss_after[pid] <= rss * (1 + MAX_RSS_GROWTH), ("from the first request", pid, rss, rss_after[pid])
    for pid, rss in rss_before.items():
        assert rss_after[pid] <= rss * (1 + MAX_RSS_GROWTH_AFTER_WARMUP), ("after the warm-up", pid, rss, rss_after[pid])
    assert_gauges_zero(served)
