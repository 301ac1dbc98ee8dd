"""Engine behaviour on the tiny random-weight Llama: stops, limits, bad input, abort, streaming, logprobs.

Every test ends with ``assert_idle(engine)``: no request left, every KV block free, accounting sound.

EOS: the tiny model never emits EOS greedily (its config sets ``pad_token_id=2``, so the tied
embedding row of token 2 is zero and EOS's logit is exactly 0 while other tokens' reach far above
it). The EOS tests therefore use a copy of the model folder whose ``generation_config.json`` also
lists, as an EOS id, a token the model does emit greedily: the engine reads EOS ids from there,
so that is a real EOS for it (same weights, same greedy tokens).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys

import pytest

from replica import LLM, SamplingParams
from replica.async_engine import AsyncLLMEngine
from replica.engine import LLMEngine
from replica.request import FinishReason
from tests.helpers import ON_TEST_DEVICE, TEST_DEVICE, assert_idle

# A hung engine loop fails fast instead of at the global 600 s timeout.
pytestmark = pytest.mark.timeout(120)

PROMPT = [101, 2020, 3030, 4040, 5050, 6060]
MAX_MODEL_LEN = 128
GREEDY = dict(temperature=0.0)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**GREEDY, **kw)


# ---- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    """One small engine for the module: 4 seats, 32 blocks of 16, max_model_len 128."""
    return LLM(
        model=tiny_llama, dtype="float32", **ON_TEST_DEVICE, max_num_seqs=4, block_size=16, num_blocks=32, max_model_len=MAX_MODEL_LEN
    )


@pytest.fixture
def engine(llm) -> LLMEngine:
    assert_idle(llm.engine)  # a failed earlier test must not leak into this one
    return llm.engine


@pytest.fixture(scope="module")
def base(llm):
    """The greedy reference: PROMPT's first 24 tokens and text, no stop of any kind."""
    [out] = llm.generate(prompt_token_ids=[PROMPT], sampling_params=greedy(max_tokens=24))
    c = out.outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 24
    assert 2 not in c.token_ids
    assert c.text == llm.tokenizer.decode(c.token_ids)  # byte-level BPE: the plain decode
    return c.token_ids, c.text


@pytest.fixture(scope="module")
def async_engine(tiny_llama):
    """A separate engine on the loop thread, with room for long generations (max_model_len 1024)."""
    engine = LLMEngine(model=tiny_llama, dtype="float32", **ON_TEST_DEVICE, max_num_seqs=4, block_size=16, num_blocks=64)
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


def boundary_stop(tokenizer, tokens, text) -> tuple[int, str, int]:
    """A stop string of 4 characters: 2 from the end of token ``i - 1`` and 2 from the start of token ``i``.

    Returns ``(i, stop, boundary)`` with ``boundary`` the text offset between the two tokens; the
    stop string occurs first exactly there.
    """
    offsets = [len(tokenizer.decode(tokens[:k])) for k in range(len(tokens) + 1)]
    for k in range(len(tokens) + 1):
        assert text.startswith(tokenizer.decode(tokens[:k]))
    for i in range(3, len(tokens) - 1):
        b = offsets[i]
        if b - offsets[i - 1] >= 2 and offsets[i + 1] - b >= 2:
            stop = text[b - 2 : b + 2]
            if text.find(stop) == b - 2:
                return i, stop, b
    raise AssertionError("no token boundary suitable for a stop string")


# ---- stop strings -----------------------------------------------------------------------------


def test_stop_string_spanning_a_token_boundary(llm, engine, base):
    tokens, text = base
    i, stop, b = boundary_stop(llm.tokenizer, tokens, text)
    [out] = llm.generate(prompt_token_ids=[PROMPT], sampling_params=greedy(max_tokens=24, stop=[stop]))
    c = out.outputs[0]
    assert c.text == text[: b - 2]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.token_ids == tokens[: i + 1]  # the token that completes the stop string is the last
    assert_idle(engine)

    [out] = llm.generate(
        prompt_token_ids=[PROMPT],
        sampling_params=greedy(max_tokens=24, stop=[stop], include_stop_str_in_output=True),
    )
    c = out.outputs[0]
    assert c.text == text[: b + 2] and c.text.endswith(stop)
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.token_ids == tokens[: i + 1]
    assert_idle(engine)


def test_stop_string_at_the_length_limit(llm, engine, base):
    """Completed by the last allowed token: "stop" wins. Cut off by the limit: the held-back start is flushed."""
    tokens, text = base
    i, stop, b = boundary_stop(llm.tokenizer, tokens, text)
    [out] = llm.generate(prompt_token_ids=[PROMPT], sampling_params=greedy(max_tokens=i + 1, stop=[stop]))
    c = out.outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == (text[: b - 2], "stop", stop)
    assert c.token_ids == tokens[: i + 1]
    # max_tokens=i ends right after the first half of the stop string: no match, and the 2
    # characters held back while they could start the stop string are part of the final text.
    [out] = llm.generate(prompt_token_ids=[PROMPT], sampling_params=greedy(max_tokens=i, stop=[stop]))
    c = out.outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == (text[:b], "length", None)
    assert c.text.endswith(stop[:2])
    assert_idle(engine)


def test_earliest_of_several_stop_strings_wins(llm, engine, base):
    tokens, text = base
    i, stop, b = boundary_stop(llm.tokenizer, tokens, text)
    later = text[-3:]
    assert text.find(later) > b
    [out] = llm.generate(prompt_token_ids=[PROMPT], sampling_params=greedy(max_tokens=24, stop=[later, stop]))
    assert out.outputs[0].text == text[: b - 2] and out.outputs[0].stop_reason == stop
    assert_idle(engine)


def test_streamed_deltas_never_contain_the_stop_string(llm, base, async_engine):
    tokens, text = base
    i, stop, b = boundary_stop(llm.tokenizer, tokens, text)

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


# ---- token-level stops and limits ---------------------------------------------------------------


def test_ignore_eos_runs_past_eos_to_max_tokens(llm, tiny_llama, base, tmp_path):
    tokens, text = base
    k = next(k for k in range(2, 10) if tokens[k] not in tokens[:k])
    eos = tokens[k]  # a token the model emits greedily as its (k+1)-th output
    folder = tmp_path / "tiny-llama-eos"
    shutil.copytree(tiny_llama, folder)
    config_path = folder / "generation_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token_id"] = [2, eos]
    config_path.write_text(json.dumps(config))
    eos_llm = LLM(model=str(folder), dtype="float32", **ON_TEST_DEVICE, max_num_seqs=2, num_blocks=8, max_model_len=MAX_MODEL_LEN)
    assert eos in eos_llm.engine.eos_token_ids

    [out] = eos_llm.generate(prompt_token_ids=[PROMPT], sampling_params=greedy(max_tokens=20))
    c = out.outputs[0]
    assert c.token_ids == tokens[: k + 1]  # EOS is kept in token_ids ...
    assert c.finish_reason == "stop" and c.stop_reason is None
    assert c.text == llm.tokenizer.decode(tokens[:k])  # ... but not in the text

    [out] = eos_llm.generate(prompt_token_ids=[PROMPT], sampling_params=greedy(max_tokens=20, ignore_eos=True))
    c = out.outputs[0]
    assert c.token_ids == tokens[:20]
    assert c.finish_reason == "length" and c.stop_reason is None
    assert c.text == llm.tokenizer.decode(tokens[:20])
    assert_idle(eos_llm.engine)


def test_max_tokens_one_gives_exactly_one_token(llm, engine, base):
    tokens, _ = base
    [out] = llm.generate(prompt_token_ids=[PROMPT], sampling_params=greedy(max_tokens=1))
    assert out.outputs[0].token_ids == tokens[:1] and out.outputs[0].finish_reason == "length"
    # Step level: the prefill step yields the only token and finishes the request.
    engine.add_request("one", prompt_token_ids=PROMPT, sampling_params=greedy(max_tokens=1))
    [delta] = engine.step()
    assert delta.request_id == "one" and delta.new_token_ids == tokens[:1]
    assert delta.finished and delta.finish_reason == "length" and delta.num_output_tokens == 1
    assert not engine.has_unfinished_requests()
    assert engine.step() == []
    assert_idle(engine)


def test_stop_token_ids_finish_with_stop_and_keep_the_token(llm, engine, base):
    tokens, text = base
    k = next(k for k in range(3, 12) if tokens[k] not in tokens[:k])
    stop_id = tokens[k]
    [out] = llm.generate(prompt_token_ids=[PROMPT], sampling_params=greedy(max_tokens=24, stop_token_ids=[stop_id]))
    c = out.outputs[0]
    assert c.token_ids == tokens[: k + 1]
    assert c.finish_reason == "stop" and c.stop_reason == stop_id
    assert c.text == llm.tokenizer.decode(tokens[:k])
    assert_idle(engine)


def test_max_model_len_reached_finishes_with_length(llm, engine):
    prompt = [1000 + i for i in range(MAX_MODEL_LEN - 5)]
    [out] = llm.generate(prompt_token_ids=[prompt], sampling_params=greedy(max_tokens=50, ignore_eos=True))
    c = out.outputs[0]
    assert len(c.token_ids) == 5 and c.finish_reason == "length"
    assert len(prompt) + len(c.token_ids) == MAX_MODEL_LEN
    # The longest prompt allowed leaves room for exactly one token.
    [out] = llm.generate(prompt_token_ids=[[7] * (MAX_MODEL_LEN - 1)], sampling_params=greedy(max_tokens=50))
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
    assert_idle(engine)


# ---- bad input ---------------------------------------------------------------------------------


def _bad_params(field: str, value) -> SamplingParams:
    """Valid params made bad after construction, so that add_request's own check is exercised."""
    params = greedy(max_tokens=4)
    setattr(params, field, value)
    return params


BAD_PARAMS = [
    ("max_tokens", -1, r"^max_tokens must be at least 0"),
    ("top_p", 0.0, r"^top_p must be in \(0, 1\]"),
    ("top_p", 1.5, r"^top_p must be in \(0, 1\]"),
    ("temperature", -1.0, r"^temperature must be >= 0"),
    ("stop", 5, r"^stop must be a string or a list of strings"),
    ("stop", [1], r"^stop must contain only strings"),
    ("logprobs", 21, r"^logprobs must be in \[0, 20\]"),
    ("n", 0, r"^n must be at least 1"),
    ("logit_bias", {5: 101}, r"^logit_bias values must be in \[-100, 100\]"),
    ("logit_bias", {"5": 1.0}, r"^logit_bias keys must be non-negative integer token ids"),
]


@pytest.mark.parametrize("field, value, message", BAD_PARAMS)
def test_sampling_params_reject_bad_values_at_construction(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_bad_input_raises_at_add_request_without_disturbing_running_requests(llm, engine):
    prompts = [[300 + i, 400 + i, 500 + i, 600 + i] * (i + 1) for i in range(3)]
    params = greedy(max_tokens=12)
    outputs: dict[str, list[int]] = {f"run-{j}": [] for j in range(3)}
    texts: dict[str, str] = {f"run-{j}": "" for j in range(3)}

    def step():
        for d in engine.step():
            outputs[d.request_id] += d.new_token_ids
            texts[d.request_id] += d.new_text

    for j, p in enumerate(prompts):
        engine.add_request(f"run-{j}", prompt_token_ids=p, sampling_params=params)
    for _ in range(3):
        step()

    def snapshot():
        s = engine.scheduler
        return (
            engine.stats(),
            sorted(s.requests),
            [
                (r.request_id, r.num_computed_tokens, list(r.output_token_ids), list(r.block_ids), r.status)
                for r in list(s.running) + list(s.waiting)
            ],
            {rid: id(d) for rid, d in engine._detokenizers.items()},  # not replaced by a duplicate
        )

    before = snapshot()
    assert before[0].num_running == 3
    bad_calls = [
        (dict(prompt=""), r"^prompt must not be empty"),
        (dict(prompt=None), r"^prompt must be a string"),
        (dict(prompt_token_ids=[]), r"^prompt_token_ids must be a non-empty list"),
        (dict(prompt_token_ids=[5, engine.vocab_size]), r"^prompt_token_ids holds 49152, outside the vocabulary"),
        (dict(prompt_token_ids=[5, -1]), r"^prompt_token_ids holds -1"),
        (dict(prompt_token_ids=[7] * MAX_MODEL_LEN), r"^prompt is 128 tokens; max_model_len is 128"),
        (dict(prompt="x " * 400), r"^prompt is \d+ tokens; max_model_len is 128"),
        (dict(prompt_token_ids=[5], sampling_params="greedy"), r"^sampling_params must be a SamplingParams"),
        (dict(request_id="run-1", prompt_token_ids=[5, 6]), r"^request_id 'run-1' is already in use"),
        (
            dict(prompt_token_ids=[5, 6], sampling_params=greedy(logit_bias={3: 1.0, engine.vocab_size: -100})),
            r"^logit_bias holds token id 49152, outside the vocabulary",
        ),
    ] + [
        (dict(prompt_token_ids=[5, 6], sampling_params=_bad_params(field, value)), message)
        for field, value, message in BAD_PARAMS
    ]
    for kwargs, message in bad_calls:
        with pytest.raises(ValueError, match=message):
            engine.add_request(**kwargs)
        assert snapshot() == before, kwargs
    # LLM.generate validates every prompt before queueing any.
    with pytest.raises(ValueError, match="prompt must not be empty"):
        llm.generate(["a fine prompt", ""], greedy(max_tokens=2))
    assert snapshot() == before

    while engine.has_unfinished_requests():
        step()
    clean = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    for j, out in enumerate(clean):
        assert outputs[f"run-{j}"] == out.outputs[0].token_ids
        assert len(out.outputs[0].token_ids) == 12
        assert texts[f"run-{j}"] == out.outputs[0].text
    assert_idle(engine)


# ---- abort ---------------------------------------------------------------------------------------


def test_abort_waiting_and_running_requests_frees_seat_and_blocks_at_once(llm, engine):
    params = greedy(max_tokens=10)
    for j in range(5):  # 4 seats: the fifth waits
        engine.add_request(f"ab-{j}", prompt_token_ids=[900 + j] * 20, sampling_params=params)
    engine.step()
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting) == (4, 1)
    assert stats.num_total_blocks - stats.num_free_blocks == 8  # 20 tokens → 2 blocks each

    out = engine.abort("ab-4")  # waiting
    assert out.finished and out.finish_reason == "abort" and out.new_token_ids == []
    assert out.num_output_tokens == 0
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_total_blocks - stats.num_free_blocks) == (4, 0, 8)

    victim = engine.scheduler.requests["ab-1"]
    out = engine.abort("ab-1")  # running: seat and blocks back before the next step
    assert out.finished and out.finish_reason == "abort" and out.num_output_tokens == 1
    assert victim.finish_reason == FinishReason.ABORT and victim.block_ids == []
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_total_blocks - stats.num_free_blocks) == (3, 0, 6)
    engine.check_integrity()
    assert engine.abort("ab-1") is None and engine.abort("no-such-request") is None

    # A new request takes the freed seat at the next step; the aborted ones never produce again.
    engine.add_request("late", prompt_token_ids=[77] * 5, sampling_params=greedy(max_tokens=2))
    deltas = engine.step()
    assert sorted(d.request_id for d in deltas) == ["ab-0", "ab-2", "ab-3", "late"]
    seen = set()
    while engine.has_unfinished_requests():
        seen.update(d.request_id for d in engine.step())
    assert not seen & {"ab-1", "ab-4"}
    assert victim.num_output_tokens == 1
    assert_idle(engine)


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


# ---- logprobs and n ------------------------------------------------------------------------------


def test_logprobs_greedy(llm, engine, base):
    tokens, _ = base
    [out] = llm.generate(prompt_token_ids=[PROMPT], sampling_params=greedy(max_tokens=6, logprobs=5))
    c = out.outputs[0]
    assert c.token_ids == tokens[:6]
    assert len(c.logprobs) == 6
    for token_id, lp in zip(c.token_ids, c.logprobs):
        assert lp.token_id == token_id
        assert lp.rank == 1 and lp.logprob <= 0
        assert len(lp.top) == 5
        assert lp.top[0] == (token_id, pytest.approx(lp.logprob))
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert len({t for t, _ in lp.top}) == 5
    assert_idle(engine)


def test_logprobs_sampled_and_sizes(llm, engine):
    params = SamplingParams(temperature=1.5, seed=3, max_tokens=8, logprobs=20, ignore_eos=True)
    [out] = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params)
    c = out.outputs[0]
    assert len(c.logprobs) == 8
    for token_id, lp in zip(c.token_ids, c.logprobs):
        assert lp.token_id == token_id and lp.logprob <= 0 and lp.rank >= 1
        assert len(lp.top) == 20
        top = dict(lp.top)
        if lp.rank <= 20:
            assert top[token_id] == pytest.approx(lp.logprob)
        else:
            assert token_id not in top
    [out] = llm.generate(prompt_token_ids=[PROMPT], sampling_params=greedy(max_tokens=3, logprobs=0))
    assert [len(lp.top) for lp in out.outputs[0].logprobs] == [0, 0, 0]
    assert [lp.rank for lp in out.outputs[0].logprobs] == [1, 1, 1]
    [out] = llm.generate(prompt_token_ids=[PROMPT], sampling_params=greedy(max_tokens=3))
    assert out.outputs[0].logprobs is None
    assert_idle(engine)


def test_n2_with_seed(llm, engine):
    params = SamplingParams(n=2, temperature=1.5, seed=11, max_tokens=8, ignore_eos=True)
    [out] = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params)
    assert [c.index for c in out.outputs] == [0, 1]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.outputs)
    assert out.outputs[0].token_ids != out.outputs[1].token_ids
    # Reproducible, and sequence j is the n=1 request seeded with seed + j.
    [again] = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    for j in (0, 1):
        single = SamplingParams(temperature=1.5, seed=11 + j, max_tokens=8, ignore_eos=True)
        [one] = llm.generate(prompt_token_ids=[PROMPT], sampling_params=single)
        assert one.outputs[0].token_ids == out.outputs[j].token_ids
    assert_idle(engine)


def test_logit_bias_bans_and_forces_tokens_and_leaves_batch_mates_unchanged(llm, engine, base):
    tokens, _ = base
    banned = set(tokens[:8])  # every token the greedy run emits first
    seeded = SamplingParams(temperature=1.0, seed=21, max_tokens=8, ignore_eos=True)
    [seeded_alone] = llm.generate(prompt_token_ids=[PROMPT], sampling_params=seeded)
    batch = [
        greedy(max_tokens=8),
        greedy(max_tokens=8, logit_bias={t: -100 for t in banned}),
        seeded,
        SamplingParams(temperature=1.0, seed=22, max_tokens=8, ignore_eos=True, logit_bias={4321: 100}),
    ]
    outs = llm.generate(prompt_token_ids=[PROMPT] * 4, sampling_params=batch)
    plain, biased, seeded_out, forced = (o.outputs[0].token_ids for o in outs)
    assert plain == tokens[:8]  # batch mates without a bias: the same tokens as alone
    assert seeded_out == seeded_alone.outputs[0].token_ids
    assert len(biased) == 8 and not banned & set(biased)
    assert forced == [4321] * 8
    # Seeded random sampling, with every token it drew unbiased banned, draws none of them.
    drawn = set(seeded_alone.outputs[0].token_ids)
    [out] = llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(
        temperature=1.0, seed=21, max_tokens=8, ignore_eos=True, logit_bias={t: -100 for t in drawn}))
    assert len(out.outputs[0].token_ids) == 8 and not drawn & set(out.outputs[0].token_ids)
    assert_idle(engine)


@pytest.mark.parametrize(
    "field,value",
    [("seed", 2**64), ("seed", -(2**63) - 1), ("skip_special_tokens", "false"), ("ignore_eos", "no"), ("include_stop_str_in_output", 1)],
)
def test_out_of_range_seed_and_non_bool_flags_are_refused(field, value):
    """Values that would fail later inside a step (torch seeds are 64-bit) are refused up front."""
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
    # seed + n - 1 must fit too (sequence i of n uses seed + i).
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**63 - 1, n=2)


# ---- step padding (CPU) -----------------------------------------------------------------------


def test_padded_size_buckets():
    """Exact up to 16 rows, then at most 12.5 % padding, and few distinct sizes for a 512 budget."""
    from replica.shapes import padded_size

    assert [padded_size(n) for n in range(1, 17)] == list(range(1, 17))
    for n in range(17, 4097):
        size = padded_size(n)
        assert n <= size <= n * 1.125, (n, size)
        assert padded_size(size) == size  # a bucket pads to itself
    assert len({padded_size(n) for n in range(1, 513)}) <= 56


def test_padded_steps_keep_tokens_and_bound_shapes(llm, engine):
    """With step padding on, each step's token count and logits rows are padded to their bucket
    (the model only sees bucket sizes), and every request's tokens are the same as with it off."""
    from replica.shapes import padded_size

    runner = engine.runner
    prompts = [[(101 + 37 * i + 11 * j) % 2000 + 50 for j in range(3 + 5 * i)] for i in range(12)]
    params = [greedy(max_tokens=4 + 3 * (i % 5)) for i in range(12)]

    def run_recording(pad: bool) -> tuple[list, list[tuple[int, int]]]:
        seen: list[tuple[int, int]] = []

        def record(module, args, kwargs):
            seen.append((kwargs["input_ids"].shape[1], kwargs["logits_to_keep"].numel()))

        runner.pad_steps = pad
        engine.reset_prefix_cache()  # both runs compute every prompt token: the same steps
        hook = runner.model.register_forward_pre_hook(record, with_kwargs=True)
        try:
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        finally:
            hook.remove()
        return [o.outputs[0].token_ids for o in outs], seen

    was, was_rows = runner.pad_steps, runner.min_rows
    runner.min_rows = 1  # float32's row floor off: the unpadded run's sizes are the exact ones
    try:
        unpadded, exact_sizes = run_recording(False)
        padded, padded_sizes = run_recording(True)
    finally:
        runner.pad_steps, runner.min_rows = was, was_rows
    assert padded == unpadded
    floor = runner.min_step_tokens  # the compiled decoder sees at least 2 tokens
    assert padded_sizes == [(max(padded_size(t), floor), padded_size(r)) for t, r in exact_sizes]
    assert padded_sizes != exact_sizes  # some steps really were padded
    assert_idle(engine)


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the CPU backend pads its prefill SDPA call; CUDA uses varlen kernels")
def test_padded_steps_bound_the_attention_shapes(tiny_llama, monkeypatch):
    """Prefill attention sees bucket sizes too: torch's 16-bit attention on CPU (flash attention on
    oneDNN brgemm kernels) builds and keeps a kernel per new query/key length, so chunks of ever
    new lengths grew a replica's memory even with step padding on (tiny Llama in bf16: +174 MiB
    over prompts of 17 to 1,016 tokens, flat on a second pass). The CPU backend runs all prefill
    chunks of a step in one SDPA call whose query and key lengths are buckets when the step is
    padded. First chunks and later chunks (a budget of 40 splits the long prompts) keep their
    tokens."""
    import torch.nn.functional as F

    from replica.shapes import padded_size

    llm = LLM(
        model=tiny_llama, dtype="float32", **ON_TEST_DEVICE, max_num_seqs=4, max_num_batched_tokens=40,
        block_size=4, num_blocks=128, max_model_len=MAX_MODEL_LEN,
    )
    runner = llm.engine.runner
    runner.backend.inline_chunk_pairs = 0  # every prefill chunk through SDPA, whose shapes this test is about
    prompts = [[(7 + 13 * i + 5 * j) % 3000 + 50 for j in range(n)] for i, n in enumerate([17, 23, 33, 61, 90, 101])]
    shapes: list[tuple[int, int]] = []
    sdpa = F.scaled_dot_product_attention

    def record(q, k, v, **kw):
        if q.shape[2] > 1:  # prefill chunks; decodes have one query each
            shapes.append((q.shape[2], k.shape[2]))
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", record)
    outs = {}
    for pad in (False, True):
        runner.pad_steps = pad
        shapes.clear()
        done = llm.generate(prompt_token_ids=prompts, sampling_params=greedy(max_tokens=5))
        outs[pad] = [o.outputs[0].token_ids for o in done]
        if pad:
            assert shapes and all(padded_size(q) == q and padded_size(k) == k for q, k in shapes), shapes
        else:
            assert any(padded_size(q) != q for q, _ in shapes)  # the workload has odd chunk lengths
    assert outs[True] == outs[False]
    assert_idle(llm.engine)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("chunks", ["as-decode-queries", "on-sdpa"])
def test_compiled_engine_never_recompiles_after_its_warm_up(tiny_llama, dtype, chunks):
    """The warm-up compiles every graph a step needs: single decodes, batched decodes, mixed steps,
    chunked prefills and preemption then run without compiling again (a compile mid-serving costs
    seconds: a served request once waited 30 s for one). On CPU, small prefill chunks keep a step
    in the decode graph; with that off (``on-sdpa``) they take the other graph."""
    import torch._dynamo

    llm = LLM(model=tiny_llama, dtype=dtype, **ON_TEST_DEVICE, max_num_seqs=3, max_num_batched_tokens=24,
              block_size=4, num_blocks=24, max_model_len=96)
    if chunks == "on-sdpa":
        llm.engine.runner.backend.inline_chunk_pairs = 0
    prompts = [[(5 + 7 * i + 3 * j) % 3000 + 40 for j in range(n)] for i, n in enumerate([1, 3, 30, 9, 50, 2])]
    params = [greedy(max_tokens=m, ignore_eos=True) for m in (12, 1, 20, 30, 5, 40)]
    with torch._dynamo.config.patch(error_on_recompile=True):
        llm.generate(prompt_token_ids=prompts[:1], sampling_params=params[0])  # one request alone
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [12, 1, 20, 30, 5, 40]
    assert llm.engine.scheduler.num_preemptions > 0
    assert_idle(llm.engine)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_eager_engine_runs_chunked_prefills_beside_decodes(tiny_llama, dtype):
    """16-bit on the fast backend without compile: prefill chunks that sample nothing (no logits
    kept) run beside decodes, every request gets its tokens and the pool ends free. float16 runs
    on CPUs whose oneDNN has no float16 path too (its linears then stay unpacked)."""
    llm = LLM(model=tiny_llama, dtype=dtype, **ON_TEST_DEVICE, compile=False, max_num_seqs=2,
              max_num_batched_tokens=8, block_size=4, num_blocks=64, max_model_len=128)
    prompts = [[(3 + 11 * i + 7 * j) % 3000 + 30 for j in range(n)] for i, n in enumerate([5, 60, 33])]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy(max_tokens=10, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [10, 10, 10]
    assert_idle(llm.engine)


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
