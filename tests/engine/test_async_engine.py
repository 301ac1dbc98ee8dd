"""The engine on its loop thread (``AsyncLLMEngine``): streamed deltas and stop strings, client
cancels and server-side aborts, deltas merged for a slow consumer, the loop thread's nice value.

Every test ends with ``assert_idle``: no request left, every KV block free, accounting sound.
"""

from __future__ import annotations

import asyncio
import sys

import pytest

from replica import SamplingParams
from replica.engine.async_engine import AsyncLLMEngine
from replica.engine.llm_engine import LLMEngine
from replica.protocol.outputs import FinishReason
from tests.engine.tiny_engine import PROMPT, boundary_stop, greedy
from tests.helpers import ON_TEST_DEVICE, assert_idle

# A hung engine loop fails fast instead of at the global 600 s timeout.
pytestmark = pytest.mark.timeout(120)

@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async-scheduling"])
def async_engine(tiny_llama, request):
    """A separate engine on the loop thread, with room for long generations (max_model_len 1024);
    every test runs with and without async scheduling (the default on CUDA), as a replica serves."""
    engine = LLMEngine(model=tiny_llama, dtype="float32", **ON_TEST_DEVICE, max_num_seqs=4, block_size=16, num_blocks=64,
                       async_scheduling=request.param)
    assert engine.async_scheduling is request.param
    aengine = AsyncLLMEngine(engine=engine)
    yield aengine
    aengine.shutdown()


def run(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def wait_until(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``predicate`` on the event loop until it holds (no fixed sleep)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.002)


def _idle_stats(stats) -> bool:
    return stats.num_running == 0 and stats.num_waiting == 0 and stats.num_free_blocks == stats.num_total_blocks


@pytest.fixture(scope="module")
def base(async_engine):
    """The greedy reference: PROMPT's first 24 tokens and text, no stop of any kind."""

    async def collect():
        return [d async for d in async_engine.generate("base", prompt_token_ids=PROMPT, sampling_params=greedy(max_tokens=24))]

    deltas = run(collect())
    tokens = [t for d in deltas for t in d.new_token_ids]
    assert len(tokens) == 24 and deltas[-1].finish_reason == "length"
    return tokens, async_engine.engine.tokenizer.decode(tokens)


# ---- stop strings in a stream --------------------------------------------------------------------


def test_streamed_deltas_never_contain_the_stop_string(base, async_engine):
    tokens, text = base
    i, stop, b = boundary_stop(async_engine.engine.tokenizer, tokens, text)

    async def stream(params, request_id):
        return [
            d
            async for d in async_engine.generate(request_id, prompt_token_ids=PROMPT, sampling_params=params)
        ]

    deltas = run(stream(greedy(max_tokens=24, stop=[stop]), "stream-stop"))
    assert all(stop not in d.new_text for d in deltas)
    assert "".join(d.new_text for d in deltas) == text[: b - 2]
    assert [t for d in deltas for t in d.new_token_ids] == tokens[: i + 1]
    # One delta per token, or fewer when the consumer falls behind (queued deltas come merged).
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True] and len(deltas) <= i + 1
    last = deltas[-1]
    assert last.finish_reason == "stop" and last.stop_reason == stop and last.num_output_tokens == i + 1
    # Without a stop string, the same deltas are the plain text; with include_stop_str_in_output
    # they end with the stop string.
    deltas = run(stream(greedy(max_tokens=24), "stream-plain"))
    assert "".join(d.new_text for d in deltas) == text
    deltas = run(stream(greedy(max_tokens=24, stop=[stop], include_stop_str_in_output=True), "stream-incl"))
    assert "".join(d.new_text for d in deltas) == text[: b + 2]
    assert _idle_stats(async_engine.engine.stats())
    assert_idle(async_engine.engine)


# ---- abort and merging ----------------------------------------------------------------------------


def test_async_cancelled_stream_aborts_the_request(async_engine):
    engine = async_engine.engine

    async def main():
        got = []
        three = asyncio.Event()

        async def consume():
            params = greedy(max_tokens=900, ignore_eos=True)
            async for d in async_engine.generate("cancel-me", prompt_token_ids=PROMPT, sampling_params=params):
                got.append(d)
                if len(got) == 3:
                    three.set()

        task = asyncio.create_task(consume())
        await three.wait()
        request = engine.scheduler.requests["cancel-me"]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: _idle_stats(async_engine.stats()), what="the abort to free seat and blocks")
        return request, got

    request, got = run(main())
    assert request.finish_reason == FinishReason.ABORT
    assert 3 <= request.num_output_tokens < 900
    assert all(not d.finished for d in got)
    assert "cancel-me" not in engine.scheduler.requests
    assert_idle(engine)


def test_a_closed_stream_s_abort_spares_a_new_request_with_its_id(async_engine, base):
    """A caller closes a stream mid-generation and at once sends a new request with the same id
    (both before the loop reads the abort): the abort ends the old request only, so the new one
    gets all its tokens and ends on its length, not with the old one's abort."""

    async def main():
        stream = async_engine.generate("reused", prompt_token_ids=PROMPT, sampling_params=greedy(max_tokens=900, ignore_eos=True))
        async for _ in stream:
            break
        await stream.aclose()  # queues the abort of the old request
        return [d async for d in async_engine.generate("reused", prompt_token_ids=PROMPT, sampling_params=greedy(max_tokens=24))]

    deltas = run(main())
    assert [t for d in deltas for t in d.new_token_ids] == base[0]
    assert deltas[-1].finish_reason == "length"
    assert_idle(async_engine.engine)


def test_async_server_side_abort_ends_the_stream_with_abort(async_engine):
    async def main():
        deltas = []
        params = greedy(max_tokens=900, ignore_eos=True)
        async for d in async_engine.generate("server-abort", prompt_token_ids=PROMPT, sampling_params=params):
            deltas.append(d)
            if len(deltas) == 2:
                async_engine.abort("server-abort")
        return deltas

    deltas = run(main())
    last = deltas[-1]
    # Tokens still queued when the abort lands come merged into the final delta.
    assert last.finished and last.finish_reason == "abort"
    assert all(not d.finished for d in deltas[:-1])
    assert last.num_output_tokens == sum(len(d.new_token_ids) for d in deltas) < 900
    assert_idle(async_engine.engine)


def test_async_deltas_merge_while_the_caller_is_busy(async_engine):
    """A consumer slower than the engine gets the deltas that piled up as one (fewer messages to
    stream), with nothing lost: tokens, text and the finish state equal the per-token stream's."""

    async def collect(pause: float) -> list:
        deltas = []
        params = greedy(max_tokens=24, ignore_eos=True)
        async for d in async_engine.generate(f"merge-{pause}", prompt_token_ids=PROMPT, sampling_params=params):
            deltas.append(d)
            await asyncio.sleep(pause)
        return deltas

    quick = run(collect(0.0))
    slow = run(collect(0.2))
    assert len(slow) < len(quick)
    assert any(len(d.new_token_ids) > 1 for d in slow)
    assert [t for d in slow for t in d.new_token_ids] == [t for d in quick for t in d.new_token_ids]
    assert "".join(d.new_text for d in slow) == "".join(d.new_text for d in quick)
    assert slow[-1].finished and slow[-1].finish_reason == "length" and slow[-1].num_output_tokens == 24
    assert_idle(async_engine.engine)


def test_async_bad_input_raises_before_queueing(async_engine):
    async def main():
        with pytest.raises(ValueError, match="prompt_token_ids"):
            async for _ in async_engine.generate("bad", prompt_token_ids=[]):
                pass

    run(main())
    assert_idle(async_engine.engine)


# ---- the loop thread ------------------------------------------------------------------------------


def _nice_of_thread(tid: int) -> int:
    """The nice value of one thread of this process (field 19 of /proc/self/task/TID/stat)."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice is per thread on Linux only")
@pytest.mark.parametrize("increment", [0, 4, 19])
def test_loop_thread_yields_the_cpu_to_its_callers(tiny_llama, increment):
    """The engine loop thread runs ``loop_thread_nice`` above the caller's nice value (capped at
    19), so the event loop that streams its outputs wins a busy core; the caller is untouched."""
    import threading

    caller = _nice_of_thread(threading.get_native_id())
    kwargs = {} if increment == 4 else {"loop_thread_nice": increment}  # 4: the default
    engine = LLMEngine(model=tiny_llama, dtype="float32", **ON_TEST_DEVICE, max_num_seqs=2, block_size=16, num_blocks=16, **kwargs)
    aengine = AsyncLLMEngine(engine=engine)
    try:

        async def one():
            return [o async for o in aengine.generate("nice", prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(max_tokens=3, ignore_eos=True))]

        assert run(one())[-1].finished
        assert _nice_of_thread(aengine._thread.native_id) == min(19, caller + increment)
        assert _nice_of_thread(threading.get_native_id()) == caller
    finally:
        aengine.shutdown()
    assert_idle(engine)
