"""Failure containment in the engine, with real failures injected into our own code.

* one request's own processing fails (its detokenizer, its sampling): that request alone ends
  with an error, its batch mates produce exactly their reference tokens;
* the batched forward fails: the requests of that step end with an error, their blocks are
  freed, waiting requests then run normally; repeated failures declare the engine state lost;
* a dead loop and a wedged loop make the replica's health check fail.

Failures are injected by replacing one method of our own objects (runner, detokenizer, the
scheduler) with one that raises, or by giving a request sampling parameters that break the
sampler; every test ends with every KV block free and ``check_integrity()`` passing.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from replica import LLM, SamplingParams
from replica.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestFailedError
from replica.engine.llm_engine import MAX_CONSECUTIVE_FAILED_STEPS, EngineStateError, LLMEngine
from tests.helpers import assert_idle

pytestmark = pytest.mark.timeout(120)

PROMPTS = [[101, 2020, 3030, 4040], [7, 8, 9, 10, 11, 12], [500, 600, 700], [42, 4242, 424, 24, 2]]
MAX_TOKENS = 8


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, **kw)


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    """3 seats (so that a fourth request waits), 32 blocks of 16."""
    return LLM(model=tiny_llama, dtype="float32", max_num_seqs=3, block_size=16, num_blocks=32, max_model_len=128)


@pytest.fixture(scope="module")
def reference(llm) -> list[list[int]]:
    """Each prompt's greedy tokens, run without any fault."""
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=greedy())
    tokens = [o.outputs[0].token_ids for o in outs]
    assert all(len(t) == MAX_TOKENS for t in tokens)
    return tokens


@pytest.fixture
def engine(llm, reference) -> LLMEngine:
    assert_idle(llm.engine)
    yield llm.engine
    assert_idle(llm.engine)


def run_all(engine: LLMEngine, max_steps: int = 200) -> dict[str, list]:
    """Step until nothing is left; every request's outputs in order."""
    outputs: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outputs
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError("requests did not finish")


def tokens_of(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def test_a_failing_detokenizer_ends_only_its_request(engine, reference):
    for i, ids in enumerate(PROMPTS[:3]):
        engine.add_request(f"r{i}", prompt_token_ids=ids, sampling_params=greedy())
    detokenizer = engine.output_processor.detokenizers["r1"]
    real_update, calls = detokenizer.update, []

    def update(token_ids, finished):
        calls.append(token_ids)
        if len(calls) == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real_update(token_ids, finished)

    detokenizer.update = update
    outputs = run_all(engine)
    assert tokens_of(outputs["r0"]) == reference[0] and outputs["r0"][-1].finish_reason == "length"
    assert tokens_of(outputs["r2"]) == reference[2] and outputs["r2"][-1].finish_reason == "length"
    failed = outputs["r1"][-1]
    assert failed.finished and failed.finish_reason == "abort"
    assert "UnicodeDecodeError" in failed.error and "injected" in failed.error
    assert tokens_of(outputs["r1"]) == reference[1][:2]  # the two tokens before the failure
    assert len(calls) == 3  # never called again after it failed


def test_a_request_that_breaks_the_sampler_ends_alone(engine, reference):
    for i, ids in enumerate(PROMPTS[:3]):
        engine.add_request(f"s{i}", prompt_token_ids=ids, sampling_params=greedy())
    # Past validation, a broken parameter cannot be written into the request's seat of the
    # persistent batch (a TypeError, kept with the seat): only this row's sampling fails.
    engine.scheduler.requests["s1"].sampling_params.temperature = None
    outputs = run_all(engine)
    assert tokens_of(outputs["s0"]) == reference[0]
    assert tokens_of(outputs["s2"]) == reference[2]
    [failed] = outputs["s1"]
    assert failed.finish_reason == "abort" and "TypeError" in failed.error


def test_a_failed_forward_ends_its_step_and_the_engine_serves_on(engine, reference, monkeypatch):
    runner = engine.runner
    real_execute, steps = runner.execute, []

    def execute(out):
        steps.append(out.step)
        if len(steps) == 3:
            raise RuntimeError("injected forward failure")
        return real_execute(out)

    monkeypatch.setattr(runner, "execute", execute)
    for i, ids in enumerate(PROMPTS):  # 4 requests, 3 seats: f3 waits
        engine.add_request(f"f{i}", prompt_token_ids=ids, sampling_params=greedy())
    outputs = run_all(engine)
    for i in range(3):  # in the failed step: ended with the error after the 2 tokens before it
        last = outputs[f"f{i}"][-1]
        assert last.finish_reason == "abort" and "injected forward failure" in last.error
        assert tokens_of(outputs[f"f{i}"]) == reference[i][:2]
    assert tokens_of(outputs["f3"]) == reference[3]  # was waiting: runs as if nothing happened
    assert outputs["f3"][-1].finish_reason == "length" and outputs["f3"][-1].error is None
    # The engine goes on: a new request gets its reference tokens.
    engine.add_request("after", prompt_token_ids=PROMPTS[0], sampling_params=greedy())
    assert tokens_of(run_all(engine)["after"]) == reference[0]


def test_repeated_forward_failures_declare_the_engine_state_lost(engine, monkeypatch):
    def execute(out):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "execute", execute)
    for i in range(MAX_CONSECUTIVE_FAILED_STEPS):
        engine.add_request(f"d{i}", prompt_token_ids=PROMPTS[0], sampling_params=greedy())
        if i < MAX_CONSECUTIVE_FAILED_STEPS - 1:
            [out] = engine.step()
            assert out.error and out.finish_reason == "abort"
    with pytest.raises(EngineStateError, match="in a row failed"):
        engine.step()


# ---- the loop thread and the replica ------------------------------------------------------------
def run(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def collect(engine: AsyncLLMEngine, request_id: str, ids: list[int], **kw) -> list:
    return [d async for d in engine.generate(request_id, prompt_token_ids=ids, sampling_params=greedy(**kw))]


def make_replica(tiny_llama, **engine_config):
    """An ``LLMReplica`` in this process (the Serve deployment's class, outside Serve)."""
    from replica.serve.deployment import LLMReplica

    config = dict(model=tiny_llama, dtype="float32", max_num_seqs=3, num_blocks=32, max_model_len=128)
    return LLMReplica({**config, **engine_config})


def test_step_failure_on_the_loop_thread_reaches_only_its_requests(tiny_llama, reference, monkeypatch):
    replica = make_replica(tiny_llama)
    aengine = replica.engine
    try:
        real_execute, calls = aengine.engine.runner.execute, []

        def execute(out):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("injected forward failure")
            return real_execute(out)

        monkeypatch.setattr(aengine.engine.runner, "execute", execute)

        async def scenario():
            results = await asyncio.gather(
                collect(aengine, "a", PROMPTS[0]), collect(aengine, "b", PROMPTS[1]), return_exceptions=True
            )
            after = await collect(aengine, "c", PROMPTS[2])
            return results, after

        results, after = run(scenario())
        assert all(isinstance(r, RequestFailedError) and "injected forward failure" in str(r) for r in results), results
        assert [t for d in after for t in d.new_token_ids] == reference[2]
        assert aengine.is_alive
        run(replica.check_health())
        assert_idle(aengine.engine)
    finally:
        aengine.shutdown()


def test_a_lost_engine_state_kills_the_loop_and_fails_the_health_check(tiny_llama, monkeypatch):
    replica = make_replica(tiny_llama)
    aengine = replica.engine
    try:
        def schedule():
            raise IndexError("injected scheduler bug")

        monkeypatch.setattr(aengine.engine.scheduler, "schedule", schedule)
        with pytest.raises(EngineDeadError, match="injected scheduler bug"):
            run(collect(aengine, "x", PROMPTS[0]))
        assert not aengine.is_alive
        with pytest.raises(RuntimeError, match="not running"):
            run(replica.check_health())
        assert run(replica.record_routing_stats())["healthy"] is False  # the router avoids it
        with pytest.raises(EngineDeadError):  # new requests are refused at once
            run(collect(aengine, "y", PROMPTS[0]))
    finally:
        aengine.shutdown()


def test_a_wedged_loop_fails_the_health_check_until_it_moves_again(tiny_llama, reference):
    replica = make_replica(tiny_llama, stall_timeout_s=0.5, enable_fault_injection=True)
    aengine = replica.engine
    try:
        run(replica.check_health())  # idle: healthy, however long ago the last step was
        replica_stall = 2.5

        async def scenario():
            await replica.inject_stall(replica_stall)
            task = asyncio.create_task(collect(aengine, "w", PROMPTS[0]))
            started = time.monotonic()
            while aengine.stalled_for() <= 0.5:
                assert time.monotonic() - started < replica_stall, "the stall was not detected"
                await asyncio.sleep(0.05)
            with pytest.raises(RuntimeError, match="wedged"):
                await replica.check_health()
            assert (await replica.record_routing_stats())["healthy"] is False
            deltas = await task  # the loop moves again and the request finishes
            await replica.check_health()
            assert (await replica.record_routing_stats())["healthy"] is True
            return deltas, time.monotonic() - started

        deltas, elapsed = run(scenario())
        assert elapsed >= replica_stall * 0.8
        assert [t for d in deltas for t in d.new_token_ids] == reference[0]
        assert_idle(aengine.engine)
    finally:
        aengine.shutdown()


def test_fault_injection_is_off_by_default(tiny_llama):
    replica = make_replica(tiny_llama)
    try:
        with pytest.raises(RuntimeError, match="fault injection is disabled"):
            run(replica.inject_stall(1.0))
    finally:
        replica.engine.shutdown()
