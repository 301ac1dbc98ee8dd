"""Engine behaviour on the tiny random-weight Llama: stops, limits, bad input, abort and
padded steps (sampling options: test_sampling_options.py; the engine on its loop thread:
test_async_engine.py; step shapes: test_step_shapes.py).

Every test ends with ``assert_idle(engine)``: no request left, every KV block free, accounting sound.

EOS: the tiny model never emits EOS greedily (its config sets ``pad_token_id=2``, so the tied
embedding row of token 2 is zero and EOS's logit is exactly 0 while other tokens' reach far above
it). The EOS tests therefore use a copy of the model folder whose ``generation_config.json`` also
lists, as an EOS id, a token the model does emit greedily: the engine reads EOS ids from there,
so that is a real EOS for it (same weights, same greedy tokens).
"""

from __future__ import annotations

import json
import shutil

import pytest

from replica import LLM, SamplingParams
from replica.protocol.outputs import FinishReason
from tests.engine.tiny_engine import MAX_MODEL_LEN, PROMPT, boundary_stop, greedy
from tests.helpers import ON_TEST_DEVICE, assert_idle

# A hung engine loop fails fast instead of at the global 600 s timeout.
pytestmark = pytest.mark.timeout(120)

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
            {rid: id(d) for rid, d in engine.output_processor.detokenizers.items()},  # not replaced by a duplicate
        )

    before = snapshot()
    assert before[0].num_running == 3
    bad_calls = [
        (dict(prompt=""), r"^prompt must not be empty"),
        (dict(prompt=None), r"^prompt must be a string"),
        (dict(prompt_token_ids=[]), r"^prompt_token_ids must be a non-empty list"),
        (dict(prompt_token_ids=[5, engine.vocab_size]), r"^prompt_token_ids: token id 49152 is outside the vocabulary"),
        (dict(prompt_token_ids=[5, -1]), r"^prompt_token_ids: token id -1 is outside"),
        (dict(prompt_token_ids=[7] * MAX_MODEL_LEN), r"^prompt_token_ids: this model's maximum context length is 128 tokens; the prompt has 128"),
        (dict(prompt="x " * 400), r"^prompt: this model's maximum context length is 128 tokens; the prompt has \d+"),
        (dict(prompt_token_ids=[5], sampling_params="greedy"), r"^sampling_params must be a SamplingParams"),
        (dict(request_id="run-1", prompt_token_ids=[5, 6]), r"^request_id 'run-1' is already in use"),
        (
            dict(prompt_token_ids=[5, 6], sampling_params=greedy(logit_bias={3: 1.0, engine.vocab_size: -100})),
            r"^logit_bias: token id 49152 is outside the vocabulary",
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


# ---- step padding (shapes: test_step_shapes.py) -----------------------------------------------


def test_padded_steps_keep_tokens_and_bound_shapes(llm, engine):
    """With step padding on, each step's token count and logits rows are padded to their bucket
    (the model only sees bucket sizes), and every request's tokens are the same as with it off."""
    from replica.kernels.shapes import padded_size

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
