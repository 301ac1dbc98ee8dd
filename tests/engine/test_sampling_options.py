"""Sampling options on the tiny random-weight Llama: logprobs, n with a seed, logit bias, and
parameters refused up front. Every test ends with ``assert_idle(engine)``."""

from __future__ import annotations

import pytest

from replica import SamplingParams
from tests.engine.tiny_engine import PROMPT, greedy
from tests.helpers import assert_idle

pytestmark = pytest.mark.timeout(120)


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
