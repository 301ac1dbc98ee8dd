"""Overload against a real served app: a burst of 10x the capacity is either served or refused
with 429 + Retry-After, never a 5xx; each replica holds at most seats + max_waiting_requests.

Two replicas with 2 seats and a waiting bound of 2: capacity 2 x (2 + 2) = 8 requests. Requests
with latency targets are shed at once (429 ``slo_unattainable``) when they ask to be and would be
late, or served and counted met or missed.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.config import ServeConfig
from replica.config.engine_config import EngineConfig

SEATS, WAITING, REPLICAS = 2, 2, 2
CAPACITY = REPLICAS * (SEATS + WAITING)
BURST = 10 * CAPACITY
MAX_TOKENS = 16
CONFIG = ServeConfig(
    app_name="e2e-overload",
    engine=EngineConfig(dtype="float32", max_num_seqs=SEATS, max_model_len=384, num_blocks=64, compile=False),
    max_waiting_requests=WAITING,
)
CHAT = [{"role": "user", "content": "Tell me about the sea."}]
KINDS = [  # (path, streamed)
    ("/v1/completions", False), ("/v1/completions", True), ("/v1/chat/completions", False), ("/v1/chat/completions", True),
]


@pytest.fixture(scope="module")
def served(deploy):
    with deploy(CONFIG, replicas=REPLICAS) as served:
        yield served


def body(path: str, stream: bool) -> dict:
    common = {"model": CONFIG.model_name, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": stream}
    if path == "/v1/completions":
        return {**common, "prompt": "The sea is"}
    return {**common, "messages": CHAT}


def text_of(path: str, r: httpx.Response) -> str:
    """The generated text of a 200 answer (streamed or not); fails on an error event."""
    if not r.headers["content-type"].startswith("text/event-stream"):
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == MAX_TOKENS, r.text
        return choice["text"] if path == "/v1/completions" else choice["message"]["content"]
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", r.text[-300:]
    parts, finish = [], None
    for event in map(json.loads, events[:-1]):
        assert "error" not in event, event
        choice = event["choices"][0]
        parts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
        finish = choice["finish_reason"] or finish
    assert finish == "length", r.text[-300:]
    return "".join(parts)


def test_burst_of_10x_capacity_is_served_or_refused_with_429(served):
    base = served.root_url
    with httpx.Client(timeout=60) as client:  # greedy references, one request at a time
        expected = {p: text_of(p, client.post(base + p, json=body(p, False))) for p in dict(KINDS)}

    peak = {"inflight": 0, "waiting": 0}
    stop = threading.Event()

    def watch() -> None:  # the replicas' own counts while the burst runs
        while not stop.is_set():
            for s in served.stats():
                peak["inflight"] = max(peak["inflight"], s["inflight"])
                peak["waiting"] = max(peak["waiting"], s["num_waiting"])

    async def burst() -> list[tuple[tuple[str, bool], httpx.Response]]:
        limits = httpx.Limits(max_connections=BURST, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            kinds = [KINDS[i % len(KINDS)] for i in range(BURST)]
            responses = await asyncio.gather(*(client.post(base + p, json=body(p, s)) for p, s in kinds))
        return list(zip(kinds, responses))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    started = time.monotonic()
    try:
        results = asyncio.run(asyncio.wait_for(burst(), timeout=180))
    finally:
        stop.set()
        watcher.join(timeout=30)
    elapsed = time.monotonic() - started

    served_ok = refused = errors_5xx = 0
    for (path, stream), r in results:
        if r.status_code == 200:
            assert text_of(path, r) == expected[path], (path, stream)
            served_ok += 1
        elif r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["code"] == "overloaded", error
            refused += 1
        else:
            errors_5xx += r.status_code >= 500
            pytest.fail(f"status {r.status_code}: {r.text[:300]}")
    print(f"\noverload: burst={BURST} capacity={CAPACITY} served={served_ok} refused={refused} 5xx={errors_5xx} "
          f"peak inflight per replica={peak['inflight']} peak waiting={peak['waiting']} in {elapsed:.1f}s")
    assert served_ok + refused == BURST and errors_5xx == 0
    assert served_ok >= CAPACITY and refused > 0
    assert peak["inflight"] <= SEATS + WAITING, peak  # running + waiting, per replica

    served.assert_idle_and_intact()
    metrics = httpx.get(base + "/metrics", timeout=30).text
    counted = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                  if line.startswith("carpool:http_requests_rejected_total{") and 'status="429"' in line)
    assert counted == refused, metrics
    r = httpx.post(base + "/v1/completions", json=body("/v1/completions", False), timeout=60)
    assert r.status_code == 200 and text_of("/v1/completions", r) == expected["/v1/completions"]


@pytest.mark.parametrize("stream", [False, True])
def test_fan_out_that_fits_the_total_capacity_is_served_when_idle(served, stream):
    """n = 6 choices on an idle server: more than one replica holds (2 + 2) but within the total
    (8). The router must spread the choices over both replicas rather than pile them onto one
    (they are all routed before any of them reaches a replica)."""
    for attempt in range(5):
        r = httpx.post(
            served.root_url + "/v1/completions",
            json={"model": CONFIG.model_name, "prompt": "The sea is", "max_tokens": 2, "n": 6, "stream": stream, "ignore_eos": True},
            timeout=120,
        )
        assert r.status_code == 200, (attempt, r.status_code, r.text[:300])
        served.wait_idle(timeout_s=10)


BEYOND = [  # (path, body, param): more choices than REPLICAS x (SEATS + WAITING) = CAPACITY
    ("/v1/completions", {"prompt": "The sea is", "n": CAPACITY + 1}, "n"),
    ("/v1/completions", {"prompt": "The sea is", "n": CAPACITY + 1, "stream": True}, "n"),
    ("/v1/completions", {"prompt": ["a", "b", "c"], "n": 3}, "prompt"),  # 9 choices
    ("/v1/chat/completions", {"messages": CHAT, "n": CAPACITY + 1}, "n"),
    ("/v1/chat/completions", {"messages": CHAT, "n": CAPACITY + 1, "stream": True}, "n"),
]


@pytest.mark.parametrize("path,extra,param", BEYOND, ids=[f"{p} {b.get('stream', False)} {q}" for p, b, q in BEYOND])
def test_more_choices_than_the_deployment_can_hold_is_a_400(served, path, extra, param):
    """Prompts x n above what every replica together can hold (8) can never be admitted: a 400
    naming the field and giving the limit, not a 429 that no retry could get past. Nothing
    reaches a replica."""
    before = [s["num_requests"] for s in served.stats()]
    r = httpx.post(served.root_url + path, json={"model": CONFIG.model_name, "max_tokens": 2, **extra}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == "invalid_value" and error["type"] == "invalid_request_error", error
    assert error["message"].startswith(f"{param}: ") and f"at most {CAPACITY}" in error["message"], error
    assert "retry-after" not in r.headers
    assert [s["num_requests"] for s in served.stats()] == before


FLOOD = 300  # far over the handle's queue bound (REPLICAS x (SEATS + WAITING) + 64 = 72)


def test_a_flood_far_over_every_queue_is_refused_with_json_429_only(served):
    """300 concurrent requests of one token, all kinds: each one is served (200) or refused with
    an OpenAI JSON 429 ``overloaded`` and ``Retry-After``, wherever it was refused (replica full,
    Serve's handle queue full, the ingress's own queue); never a 5xx, never Serve's plain text."""
    base = served.root_url

    async def flood() -> list[httpx.Response | BaseException]:
        limits = httpx.Limits(max_connections=FLOOD, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=90, limits=limits) as client:
            kinds = [KINDS[i % len(KINDS)] for i in range(FLOOD)]
            return await asyncio.gather(
                *(client.post(base + p, json={**body(p, s), "max_tokens": 1}) for p, s in kinds), return_exceptions=True
            )

    started = time.monotonic()
    results = asyncio.run(asyncio.wait_for(flood(), timeout=150))
    elapsed = time.monotonic() - started
    statuses: dict[int, int] = {}
    for r in results:
        assert not isinstance(r, BaseException), repr(r)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code in (200, 429), (r.status_code, r.headers, r.text[:300])
        if r.status_code == 429:
            assert r.headers.get("content-type", "").startswith("application/json"), (r.headers, r.text[:300])
            assert int(r.headers["retry-after"]) >= 1, r.headers
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["code"] == "overloaded", error
    print(f"\nflood: {FLOOD} requests in {elapsed:.1f}s: {statuses}")
    assert statuses.get(200, 0) >= CAPACITY, statuses
    served.wait_idle(timeout_s=30)


# ---- latency targets (x-slo-ttft-ms, x-slo-tpot-ms, x-slo-shed) ----------------------------------
LONG_TOKENS = 360  # seat holders: longer than the test needs them; they hang up when it is done


def slo_counts(served) -> dict[str, float]:
    """``carpool:requests_slo_total`` by outcome, summed over the replicas."""
    counts = {"met": 0.0, "missed": 0.0, "shed": 0.0}
    for family in text_string_to_metric_families(httpx.get(served.root_url + "/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == "carpool:requests_slo_total":
                counts[sample.labels["outcome"]] += sample.value
    return counts


def test_latency_targets_are_met_shed_at_once_or_counted_missed(served):
    """Through the ``openai`` client: on an idle server a request with a 60 s TTFT target is served
    and counted met. With every seat of both replicas held by long requests, a request that
    asks to be shed for a 50 ms target gets a 429 ``slo_unattainable`` with ``Retry-After`` while
    the seat holders still run (nothing queued for it); the same request without shedding waits
    for a seat, which the holders give up by hanging up, and is served late and counted missed.
    Bad header values are 400s naming the header."""
    import openai

    client = served.client
    before = slo_counts(served)
    met = client.completions.create(
        model=served.model, prompt="The sea is", max_tokens=4, temperature=0,
        extra_headers={"x-slo-ttft-ms": "60000", "x-slo-tpot-ms": "60000", "x-slo-shed": "true"},
    )
    assert met.choices[0].finish_reason == "length"

    release = threading.Event()
    statuses: list[int] = []
    holders: list[threading.Thread] = []

    def hold_a_seat() -> None:
        def hold() -> None:  # streams until released, then hangs up: the replica aborts it
            body = {"model": served.model, "prompt": "The sea is", "max_tokens": LONG_TOKENS, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            with httpx.stream("POST", served.base_url + "/completions", json=body, timeout=180) as r:
                statuses.append(r.status_code)
                release.wait(180)

        holders.append(threading.Thread(target=hold))
        holders[-1].start()

    # One holder at a time, the next once the last runs, so the router sees each one taken:
    # sent together, a burst can be ranked on counts that lag and leave one replica a seat short.
    deadline = time.monotonic() + 60
    while True:
        stats = served.stats()
        if all(s["num_running"] == SEATS for s in stats):
            break
        assert time.monotonic() < deadline, stats
        if sum(s["num_running"] for s in stats) == len(holders):  # each one runs
            hold_a_seat()
        time.sleep(0.02)
    waiting = [s["num_waiting"] for s in stats]
    try:
        shed_at = {"x-slo-ttft-ms": "50", "x-slo-shed": "true"}
        retrying = openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=2)  # the client's default
        for c in (client, client, retrying):  # x-should-retry: false: the default client does not send it again
            with pytest.raises(openai.RateLimitError) as info:
                c.completions.create(model=served.model, prompt="Hi", max_tokens=4, extra_headers=shed_at)
            error = info.value.body
            assert error["code"] == "slo_unattainable" and error["param"] == "x-slo-ttft-ms", error
            assert int(info.value.response.headers["retry-after"]) >= 1
            assert info.value.response.headers["x-should-retry"] == "false"
        stats = served.stats()
        assert [s["num_running"] for s in stats] == [SEATS] * REPLICAS, stats  # the holders still run
        assert [s["num_waiting"] for s in stats] == waiting, stats  # and nothing was queued for the shed ones

        # Without shedding, the same target: it waits for a seat (at least the 0.2 s before the
        # holders hang up), then is served, late.
        answers: list = []
        late = threading.Thread(target=lambda: answers.append(client.chat.completions.create(
            model=served.model, messages=CHAT, max_tokens=4, temperature=0, extra_headers={"x-slo-ttft-ms": "50"},
        )))
        late.start()
        queued_by = time.monotonic() + 60
        while True:  # until it queues
            stats = served.stats()
            if sum(s["num_waiting"] for s in stats) > sum(waiting):
                break
            assert time.monotonic() < queued_by, stats
            time.sleep(0.02)
        time.sleep(0.2)
    finally:
        release.set()
        for t in holders:
            t.join(60)
    late.join(60)
    assert [a.choices[0].finish_reason for a in answers] == ["length"]
    assert statuses == [200] * len(holders)
    served.wait_idle(timeout_s=30)
    after = slo_counts(served)
    assert {k: after[k] - before[k] for k in after} == {"met": 1, "missed": 1, "shed": 3}

    for headers, param in (({"x-slo-ttft-ms": "soon"}, "x-slo-ttft-ms"), ({"x-slo-shed": "true"}, "x-slo-shed")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=2, extra_headers=headers)
        assert info.value.body["param"] == param, info.value.body
    served.wait_idle(timeout_s=30)
