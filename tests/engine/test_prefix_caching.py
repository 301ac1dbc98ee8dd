"""Prefix caching: tokens identical with caching on and off (fp32, greedy and seeded), in every
situation that reuses, shares, preempts or evicts a cached block; hit accounting; a failed step
leaves nothing half written in the cache.

Caching off is the reference: with it off the engine is the one the fidelity suite holds equal to
transformers ``generate``.
"""

from __future__ import annotations

import random

import pytest

from replica import LLM, SamplingParams
from tests.helpers import ON_TEST_DEVICE, assert_idle

pytestmark = pytest.mark.timeout(300)

BS = 16
SYSTEM = [random.Random(3).randrange(3, 49152) for _ in range(40)]  # 2.5 blocks: a partial last block


def conversations(seed: int = 0) -> list[list[int]]:
    """Prompts sharing prefixes of every kind: the shared 40-token head alone, head + short and long
    tails, a prompt that is exactly a run of full blocks, one that extends another, duplicates."""
    rng = random.Random(seed)
    tail = lambda n: [rng.randrange(3, 49152) for _ in range(n)]  # noqa: E731
    a = SYSTEM + tail(9)
    prompts = [SYSTEM, a, SYSTEM + tail(30), a + tail(20), SYSTEM[:32], SYSTEM[:32] + tail(1), a, tail(50), a + tail(3)]
    return prompts


def make(model: str, caching: bool, **kw) -> LLM:
    return LLM(model=model, dtype="float32", **ON_TEST_DEVICE, block_size=BS, enable_prefix_caching=caching, **kw)


def run_waves(llm: LLM, prompts, params) -> list[list[int]]:
    """The prompts twice: all at once (hits inside one step and across steps), then again (hits
    on blocks freed by the first wave)."""
    outs = []
    for _ in range(2):
        outs += [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    return outs


SCENARIOS = {
    "batched": dict(max_num_seqs=8),
    "chunked": dict(max_num_seqs=8, max_num_batched_tokens=24),
    # 14 blocks of 16 tokens for 9 prompts of up to 72 tokens + 12 outputs: preemption, and
    # cached free blocks evicted for new ones.
    "preempted-evicted": dict(max_num_seqs=9, num_blocks=14, max_model_len=112),
    "few-seats": dict(max_num_seqs=2),
}


@pytest.mark.parametrize("policy", ["continuous", "static"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_tokens_identical_with_caching_on_and_off(tiny_llama, scenario, policy):
    prompts = conversations()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    results = {}
    for caching in (False, True):
        llm = make(tiny_llama, caching, batching_policy=policy, **SCENARIOS[scenario])
        results[caching] = run_waves(llm, prompts, params)
        stats = llm.engine.stats()
        if caching:
            assert stats.prefix_cache_hits > 0 and stats.prefix_cache_hits <= stats.prefix_cache_queries
        else:
            assert stats.prefix_cache_queries == stats.prefix_cache_hits == stats.num_cached_blocks == 0
        if scenario == "preempted-evicted" and caching:
            assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.block_manager.num_evictions > 0
        assert_idle(llm.engine)
    assert results[True] == results[False]


def test_seeded_sampling_and_n_choices_unchanged(tiny_llama):
    """``n = 3`` seeded choices share their prompt's blocks within the step that admits them; the
    samples equal those of an engine without caching."""
    params = SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=10, ignore_eos=True)
    prompts = conversations()[:4]
    got = {}
    for caching in (False, True):
        llm = make(tiny_llama, caching, max_num_seqs=12)
        got[caching] = [[c.token_ids for c in o.outputs] for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
        if caching:
            # Choices 2 and 3 of each prompt find choice 1's full blocks, registered in the same step.
            full = sum(len(p) - 1 for p in prompts) // 1
            assert llm.engine.stats().prefix_cache_hits >= 2 * sum(((len(p) - 1) // BS) * BS for p in prompts)
            assert full > 0
        assert_idle(llm.engine)
    assert got[True] == got[False]


def test_hit_accounting_and_the_last_token_is_always_computed(tiny_llama):
    llm = make(tiny_llama, True, max_num_seqs=4)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    first = SYSTEM[:32]  # exactly 2 full blocks
    [a] = llm.generate(prompt_token_ids=[first], sampling_params=params)
    assert (engine.stats().prefix_cache_queries, engine.stats().prefix_cache_hits) == (32, 0)
    # The same 32 tokens again: only the first block may be reused, the last token must be computed.
    [b] = llm.generate(prompt_token_ids=[first], sampling_params=params)
    assert (engine.stats().prefix_cache_queries, engine.stats().prefix_cache_hits) == (64, 16)
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 16)  # each request's own hits
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    # 40 tokens: 2 full blocks cached (the 3rd, partial, is computed).
    llm.generate(prompt_token_ids=[SYSTEM], sampling_params=params)
    assert engine.stats().prefix_cache_hits == 16 + 32
    # A request that asks for prompt logprobs needs every position's logits: no lookup.
    llm.generate(prompt_token_ids=[SYSTEM], sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert engine.stats().prefix_cache_queries == 64 + 40
    # Output blocks are cached too: a prompt resending prompt + output hits past the prompt.
    [c] = llm.generate(prompt_token_ids=[SYSTEM], sampling_params=SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    before = engine.stats().prefix_cache_hits
    llm.generate(prompt_token_ids=[SYSTEM + c.outputs[0].token_ids + [7, 8]], sampling_params=params)
    assert engine.stats().prefix_cache_hits - before == 64  # 70 + 2 tokens: 4 full blocks
    assert_idle(engine)


def test_reset_prefix_cache_and_disabled_caching(tiny_llama):
    llm = make(tiny_llama, True, max_num_seqs=4)
    llm.generate(prompt_token_ids=[SYSTEM], sampling_params=SamplingParams(max_tokens=2))
    assert llm.engine.stats().num_cached_blocks == 2
    assert llm.engine.reset_prefix_cache() == 2 and llm.engine.stats().num_cached_blocks == 0
    assert_idle(llm.engine)


def test_a_failed_step_leaves_no_block_in_the_cache(tiny_llama):
    """Blocks registered for a step whose forward fails are half written: they leave the cache, so
    a later prompt with the same tokens computes them again (and gets the right tokens)."""
    llm = make(tiny_llama, True, max_num_seqs=4)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    [want] = make(tiny_llama, False, max_num_seqs=4).generate(prompt_token_ids=[SYSTEM], sampling_params=params)

    def boom(*args, **kwargs):
        raise RuntimeError("injected forward failure")

    engine.add_request("doomed", prompt_token_ids=SYSTEM, sampling_params=params)
    original = engine.runner.execute
    engine.runner.execute = boom
    try:
        [failed] = engine.step()
    finally:
        engine.runner.execute = original
    assert failed.error and failed.finish_reason == "abort"
    assert engine.stats().num_cached_blocks == 0
    [again] = llm.generate(prompt_token_ids=[SYSTEM], sampling_params=params)
    assert again.outputs[0].token_ids == want.outputs[0].token_ids
    assert_idle(engine)
