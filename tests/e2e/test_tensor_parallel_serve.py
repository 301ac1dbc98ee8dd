"""A tensor-parallel replica served end to end: ``tensor_parallel_size=2`` on the test's Ray cluster
(2 CPUs: one placement group of 2 bundles of 1 CPU, rank 0 the replica actor, rank 1 a Ray actor),
with a tiny Llama whose heads split over 2.

* The real ``openai`` client gets the same greedy text streamed and not, the router and
  ``/metrics`` see one replica, and the run ends with every block free.
* Rank 1's process killed (SIGKILL) while a request streams: the stream ends (an error event, no
  hang) within 60 s, the replica's health check fails, and Serve replaces the whole group, which
  serves again.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
import torch

from cluster.config import ServeConfig
from replica.config.engine_config import EngineConfig
from tests.engine.conftest import TINY

pytestmark = pytest.mark.slow

RECOVERY_S = 180.0  # Serve's 3 failed health checks 5 s apart, then a new group (2 processes) loads


@pytest.fixture(scope="module")
def tiny_llama_path(tmp_path_factory, smollm2_tokenizer) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(1234)
    folder = tmp_path_factory.mktemp("tiny-llama-tp")
    AutoModelForCausalLM.from_config(LlamaConfig(**TINY), dtype=torch.float32).save_pretrained(folder)
    smollm2_tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def app(deploy, tiny_llama_path):
    engine = EngineConfig(
        model=tiny_llama_path, dtype="float32", tensor_parallel_size=2, max_num_seqs=4, num_blocks=64,
        max_model_len=256, compile=False,
    )
    with deploy(ServeConfig(app_name="e2e-tp", served_model_name="tiny", engine=engine), replicas=1) as served:
        yield served


def rank_actor_pids() -> set[int]:
    """Processes of running rank actors (Ray titles them ``ray::RankActor...``)."""
    import psutil

    pids = set()
    for process in psutil.process_iter(["cmdline", "status"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if cmdline.startswith("ray::RankActor") and process.info["status"] != psutil.STATUS_ZOMBIE:
            pids.add(process.pid)
    return pids


def test_a_tp2_replica_serves_through_the_openai_client(app):
    plain = app.client.completions.create(model=app.model, prompt="Once upon a time", max_tokens=16, temperature=0)
    streamed = "".join(
        chunk.choices[0].text
        for chunk in app.client.completions.create(model=app.model, prompt="Once upon a time", max_tokens=16, temperature=0, stream=True)
    )
    assert plain.usage.completion_tokens == 16 and streamed == plain.choices[0].text
    [stats] = app.stats()  # the router's view: one replica for the group of two ranks
    assert stats["healthy"] and len(rank_actor_pids()) == 1
    metrics = httpx.get(app.root_url + "/metrics", timeout=30).text
    replicas = {line.split('replica="')[1].split('"')[0] for line in metrics.splitlines() if line.startswith("carpool:num_slots{")}
    assert len(replicas) == 1, replicas
    app.assert_idle_and_intact()


def test_killing_rank_1_ends_the_stream_and_serve_replaces_the_group(app):
    [old] = app.stats()
    [rank1] = rank_actor_pids()
    body = {"model": app.model, "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True}
    events: list[str] = []
    started = None
    with httpx.stream("POST", app.base_url + "/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if started is None:  # the first token is out: kill rank 1 mid-stream
                    os.kill(rank1, signal.SIGKILL)
                    started = time.monotonic()
    assert time.monotonic() - started < 60
    assert events[-1] == "[DONE]" and '"error"' in events[-2], events[-2:]
    deadline = time.monotonic() + RECOVERY_S
    while True:
        assert time.monotonic() < deadline, "the group was not replaced"
        try:
            stats = app.stats()
            if len(stats) == 1 and stats[0]["pid"] != old["pid"] and stats[0]["healthy"]:
                out = app.client.completions.create(model=app.model, prompt="Once upon a time", max_tokens=4, temperature=0)
                if out.usage.completion_tokens == 4:
                    break
        except Exception:  # the replica is being replaced
            pass
        time.sleep(1)
    assert rank1 not in rank_actor_pids() and len(rank_actor_pids()) == 1
    app.assert_idle_and_intact()
