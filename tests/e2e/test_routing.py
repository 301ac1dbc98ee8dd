"""Two replicas behind the request router: a burst spreads over both, and every request gets the
same tokens it gets alone (float32, greedy)."""

from __future__ import annotations

import asyncio
import os

import openai
import pytest

from cluster.config import ServeConfig
from replica.config.engine_config import EngineConfig
from tests.e2e.conftest import process_environ

# 8 seats per replica: 32 requests over 2 replicas also exercise each engine's waiting queue. With
# async scheduling, the default on CUDA, so that the served path runs it on CPU too.
ENGINE = EngineConfig(dtype="float32", max_num_seqs=8, max_model_len=256, num_blocks=128, compile=False,
                      async_scheduling=True)
CONFIG = ServeConfig(app_name="e2e-routing", engine=ENGINE)
TOPICS = ["the sea", "a red fox", "winter", "the moon", "bread", "a violin", "rain", "mountains"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def served(deploy):
    with deploy(CONFIG, replicas=2) as served:
        yield served


def messages(topic: str) -> list[dict]:
    return [{"role": "user", "content": f"Write one short sentence about {topic}."}]


async def stream_one(client: openai.AsyncOpenAI, model: str, topic: str) -> tuple[str, str | None, int]:
    stream = await client.chat.completions.create(
        model=model, messages=messages(topic), max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, tokens = [], None, 0
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(text), finish, tokens


def test_32_concurrent_streams_over_2_replicas_match_solo_outputs(served):
    assert len(served.replica_actors()) == 2

    async def run():
        async with openai.AsyncOpenAI(base_url=served.base_url, api_key="unused", max_retries=0, timeout=120) as client:
            # Alone: one request at a time, so each runs in a batch of one.
            solo = {}
            for topic in TOPICS:
                solo[topic] = await stream_one(client, served.model, topic)
            before = {s["replica"]: s["num_requests"] for s in served.stats()}
            burst = [TOPICS[i % len(TOPICS)] for i in range(32)]
            results = await asyncio.gather(*(stream_one(client, served.model, t) for t in burst))
            return solo, burst, results, before

    solo, burst, results, before = asyncio.run(run())
    for topic, result in zip(burst, results):
        assert result == solo[topic], (topic, result, solo[topic])
    served_per_replica = {s["replica"]: s["num_requests"] - before[s["replica"]] for s in served.stats()}
    assert sum(served_per_replica.values()) == 32
    assert all(n > 0 for n in served_per_replica.values()), served_per_replica


def test_both_replicas_report_routing_stats(served):
    stats = served.stats()
    assert len({s["replica"] for s in stats}) == 2
    for s in stats:
        assert s["num_slots"] == 8
        assert s["num_total_blocks"] == 128
        assert s["free_seats"] == 8


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_replicas_run_with_carpools_serve_settings(served):
    """The Serve settings of cluster.app.SERVE_ENV reach the replica processes (Serve reads them
    when a process starts; the ingress shares the same environment)."""
    from cluster.app import SERVE_ENV

    for s in served.stats():
        environ = process_environ(s["pid"])
        assert {name: environ.get(name) for name in SERVE_ENV} == SERVE_ENV, s["replica"]
