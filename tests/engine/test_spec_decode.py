"""Speculative decoding gives the tokens the model gives without it.

Greedy: equal to transformers ``generate`` (fp32) with prompt-lookup drafts and with draft models
(the target itself, every draft accepted; another model, most rejected), alone, batched, chunked
and preempted, both policies, compiled and eager. Sampled: a seed gives the same tokens with
speculation on and off (the verification draws once per emitted token, as without it), and the
token distribution matches (a chi-square test that fails when the acceptance rule is broken).
Logprobs, stop strings and structured output behave as without speculation.
"""

from __future__ import annotations

import pytest
import torch

from replica import LLM, SamplingParams
from replica.sample import rejection_sampler
from tests.engine.test_fidelity import WORKLOAD, assert_reference_outputs, reference_tokens, run_engine
from tests.helpers import ON_TEST_DEVICE, assert_idle

# adaptive=False: draft wherever a proposal exists, so that verification and rollback run often.
NGRAM = dict(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3, adaptive=False)
SCENARIOS = {
    "all-at-once": dict(max_num_seqs=32),
    "chunked-prefill": dict(max_num_seqs=8, max_num_batched_tokens=24),
    "preemption": dict(max_num_seqs=16, num_blocks=12, max_model_len=192),
}


def draft(model: str, k: int = 3) -> dict:
    return dict(method="draft_model", model=model, num_speculative_tokens=k, adaptive=False)


def _llm(path: str, spec: dict | None, **kwargs) -> LLM:
    return LLM(model=path, dtype="float32", **ON_TEST_DEVICE, speculative_config=spec, **kwargs)


def _assert_drafts_verified(llm: LLM, *, some_rejected: bool = True) -> None:
    """Drafts were verified, some kept (and, ``some_rejected``, some thrown away): the test ran
    the verification and the rollback, not only the plain path."""
    stats = llm.engine.spec_decode_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0, stats
    if some_rejected:
        assert stats.num_accepted_tokens < stats.num_draft_tokens, stats


@pytest.mark.parametrize("compile_", [True, False], ids=["compiled", "eager"])
@pytest.mark.parametrize("policy", ["continuous", "static"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_with_prompt_lookup_matches_transformers_generate(tiny_llama, scenario, policy, compile_):
    """A random model rarely repeats its context, so prompt lookup drafts seldom here (the real
    model's test below drafts all the time); every draft made is verified exactly."""
    llm = _llm(tiny_llama, NGRAM, batching_policy=policy, compile=compile_, **SCENARIOS[scenario])
    got, reasons = run_engine(llm, WORKLOAD, None)
    assert_reference_outputs(got, reasons, reference_tokens(tiny_llama, WORKLOAD))
    assert llm.engine.spec_decode_stats.num_draft_tokens > 0
    if scenario == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    assert_idle(llm.engine)


@pytest.fixture(scope="module")
def grounded(smollm2_path, smollm2_tokenizer):
    """4 input-grounded prompts (``carpool bench``'s workload: copy or edit a text) for SmolLM2 in
    fp32, and transformers' greedy tokens for them (36 each)."""
    from transformers import AutoModelForCausalLM

    from cluster.bench.workloads.input_grounded import input_grounded_prompts

    prompts = [
        smollm2_tokenizer.apply_chat_template(
            [{"role": "user", "content": p.prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for p in input_grounded_prompts(4, seed=1)
    ]
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    expected = [
        model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                       max_new_tokens=36, do_sample=False)[0, len(ids):].tolist()
        for ids in prompts
    ]
    return [(ids, 36) for ids in prompts], expected


@pytest.mark.parametrize(
    "kwargs",
    [dict(batching_policy="continuous", compile=True, max_num_seqs=4),
     dict(batching_policy="static", compile=False, max_num_seqs=4, max_num_batched_tokens=64, num_blocks=40)],
    ids=["continuous-compiled", "static-eager-chunked-preempted"],
)
def test_prompt_lookup_on_the_real_model_matches_transformers_generate(smollm2_path, grounded, kwargs):
    """SmolLM2 copies from its prompt here: prompt lookup drafts most steps, and most drafts are
    kept, some rejected; the tokens are transformers' (fp32), batched, chunked and preempted."""
    workload, expected = grounded
    llm = _llm(smollm2_path, {**NGRAM, "prompt_lookup_min": 2}, **kwargs)
    got, _ = run_engine(llm, workload, "staggered")
    assert got == expected
    _assert_drafts_verified(llm)
    if "num_blocks" in kwargs:
        assert llm.engine.scheduler.num_preemptions > 0
    assert_idle(llm.engine)


@pytest.mark.parametrize("scenario", ["all-at-once", "preemption"])
@pytest.mark.parametrize("drafter", ["itself", "qwen2"])
def test_greedy_with_a_draft_model_matches_transformers_generate(tiny_model_factory, tiny_llama, drafter, scenario):
    """The target as its own draft (every draft accepted: rows emit up to 1 + k tokens) and a
    different tiny model (most drafts rejected, blocks rolled back); batched, then alone."""
    draft_path = tiny_llama if drafter == "itself" else tiny_model_factory("qwen2")
    llm = _llm(tiny_llama, draft(draft_path), **SCENARIOS[scenario])
    expected = reference_tokens(tiny_llama, WORKLOAD)
    got, reasons = run_engine(llm, WORKLOAD, "staggered")
    assert_reference_outputs(got, reasons, expected)
    for i in (2, 9):  # alone
        [alone], _ = run_engine(llm, [WORKLOAD[i]], None)
        assert alone == expected[i], f"request {i} alone"
    stats = llm.engine.spec_decode_stats
    if drafter == "itself":
        assert stats.num_accepted_tokens == stats.num_draft_tokens > 0  # fp32: the same argmax
    else:
        assert stats.num_draft_tokens > stats.num_accepted_tokens
    assert_idle(llm.engine)


def _sampled(llm: LLM, params: list[SamplingParams], prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert_idle(llm.engine)
    return [o.outputs[0].token_ids for o in outs]


def _sampling_params(n: int) -> list[SamplingParams]:
    """Seeded sampling with every logits processor that reads the tokens so far."""
    kinds = [
        dict(temperature=0.7, top_k=8),
        dict(temperature=1.0, top_p=0.8, repetition_penalty=1.3),
        dict(temperature=0.5, frequency_penalty=0.8, presence_penalty=0.4, min_tokens=6),
        dict(temperature=0.9, min_p=0.1, logit_bias={17: 3.0, 2: -100}),
        dict(temperature=0.0, repetition_penalty=1.2),
    ]
    return [SamplingParams(**kinds[i % len(kinds)], seed=i, max_tokens=16) for i in range(n)]


def test_a_seed_gives_the_same_tokens_with_and_without_speculation(tiny_llama):
    """The verification samples each position as the step would without drafts (one draw of the
    request's generator per emitted token), so seeded tokens are identical, penalties and
    min_tokens included."""
    prompts = [ids for ids, _ in WORKLOAD[:10]]
    params = _sampling_params(len(prompts))
    without = _sampled(_llm(tiny_llama, None, max_num_seqs=8), params, prompts)
    spec = _llm(tiny_llama, draft(tiny_llama, 4), max_num_seqs=8)
    assert _sampled(spec, params, prompts) == without
    _assert_drafts_verified(spec)  # sampled rows accept the argmax draft only sometimes


def _chi_square_p(a: list[int], b: list[int]) -> float:
    """p-value of Pearson's chi-square test that two samples of tokens come from one distribution
    (a 2 x categories contingency table; the survival function of chi-square with k - 1 degrees of
    freedom is the regularized upper incomplete gamma Q(k / 2, x / 2))."""
    cats = sorted(set(a) | set(b))
    stat = 0.0
    for c in cats:
        row = (a.count(c), b.count(c))
        total = row[0] + row[1]
        for observed, n in zip(row, (len(a), len(b))):
            expected = total * n / (len(a) + len(b))
            stat += (observed - expected) ** 2 / expected
    dof = len(cats) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def test_the_distribution_with_speculation_is_the_models(tiny_llama, monkeypatch):
    """Tokens at the first 4 positions, 300 seeded requests with speculation (the target as its own
    draft: its argmax is proposed, and kept only when the draw agrees) against 300 with other seeds
    without: a chi-square test does not tell them apart. With the acceptance rule broken (every
    draft kept), the same test does, by far: the test can fail."""
    prompt = WORKLOAD[3][0]
    n = 300
    params = SamplingParams(temperature=1.0, top_k=4, max_tokens=4)
    seeded = lambda first: [SamplingParams(**{**params.__dict__, "seed": first + i}) for i in range(n)]  # noqa: E731
    base = _sampled(_llm(tiny_llama, None, max_num_seqs=32), seeded(10_000), [prompt] * n)
    spec_llm = _llm(tiny_llama, draft(tiny_llama, 3), max_num_seqs=32)
    spec = _sampled(spec_llm, seeded(0), [prompt] * n)
    _assert_drafts_verified(spec_llm)
    for j in range(4):
        assert _chi_square_p([t[j] for t in spec], [t[j] for t in base]) > 1e-3, f"position {j}"
    monkeypatch.setattr(rejection_sampler, "accept_draft", lambda sampled, proposed: True)
    broken = _sampled(spec_llm, seeded(0), [prompt] * n)
    assert min(_chi_square_p([t[j] for t in broken], [t[j] for t in base]) for j in range(1, 4)) < 1e-6


def test_logprobs_and_stop_strings_as_without_speculation(tiny_llama):
    prompts = [ids for ids, _ in WORKLOAD[:6]]
    plain = _llm(tiny_llama, None, max_num_seqs=8)
    spec = _llm(tiny_llama, draft(tiny_llama, 4), max_num_seqs=8)
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=3)
    a = plain.generate(prompt_token_ids=prompts, sampling_params=params)
    b = spec.generate(prompt_token_ids=prompts, sampling_params=params)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for p, q in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, strict=True):
            assert p.token_id == q.token_id and p.rank == q.rank
            assert p.logprob == pytest.approx(q.logprob, abs=1e-4)
            assert [t for t, _ in p.top] == [t for t, _ in q.top]
    # A stop string inside a step's accepted drafts: the request ends there, later tokens dropped.
    text = a[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = SamplingParams(temperature=0, max_tokens=20, stop=[stop])
    [x] = plain.generate(prompt_token_ids=prompts[:1], sampling_params=params)
    [y] = spec.generate(prompt_token_ids=prompts[:1], sampling_params=params)
    assert (y.outputs[0].text, y.outputs[0].token_ids, y.outputs[0].finish_reason, y.outputs[0].stop_reason) == (
        x.outputs[0].text, x.outputs[0].token_ids, "stop", stop
    )
    assert len(y.outputs[0].token_ids) < 20
    assert_idle(spec.engine)


def test_structured_output_refuses_drafts_the_grammar_forbids(tiny_llama):
    """The draft model proposes its unconstrained argmax; the grammar masks the target's logits,
    so a forbidden draft is never accepted, and the output is the one without speculation."""
    from replica.protocol.constraints import StructuredOutputsParams

    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a", "b"]}
    params = [
        SamplingParams(temperature=t, seed=i, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema))
        for i, t in enumerate([0.0, 0.0, 0.8, 0.8])
    ]
    prompts = [ids for ids, _ in WORKLOAD[:4]]
    without = _sampled(_llm(tiny_llama, None, max_num_seqs=4), params, prompts)
    spec = _llm(tiny_llama, draft(tiny_llama, 4), max_num_seqs=4)
    assert _sampled(spec, params, prompts) == without
    assert spec.engine.spec_decode_stats.num_draft_tokens > spec.engine.spec_decode_stats.num_accepted_tokens


def test_speculation_turns_async_scheduling_off_and_bad_drafts_are_refused(tiny_llama, tiny_model_factory, tmp_path):
    llm = _llm(tiny_llama, NGRAM, async_scheduling=True, max_num_seqs=4)
    assert not llm.engine.async_scheduling
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.engine.conftest import TINY

    small = AutoModelForCausalLM.from_config(LlamaConfig(**{**TINY, "vocab_size": 1000}))
    small.save_pretrained(tmp_path / "small")
    llm.tokenizer.save_pretrained(tmp_path / "small")
    with pytest.raises(ValueError, match="speculative_config.model: the draft model's vocabulary has 1000 tokens"):
        _llm(tiny_llama, draft(str(tmp_path / "small")), max_num_seqs=4)


def test_a_request_that_breaks_verification_ends_alone(tiny_llama, monkeypatch):
    """A request whose sampling raises (broken mid-run: verifying any rows with it raises) ends with
    an error; the other rows of the step are verified one by one and go on, as without speculation.
    (Its settings cannot be broken mid-run: the persistent batch wrote them when it took its seat.)"""
    from replica.worker import step_sampler

    llm = _llm(tiny_llama, draft(tiny_llama, 3), max_num_seqs=4, compile=False)
    engine = llm.engine
    real_verify, broken = step_sampler.verify, []

    def verify(sampler, logits, metadata, drafts):
        # The metadata holds each request's own output token list: s1's marks its row.
        if any(out is b for out in metadata.output_token_ids for b in broken):
            raise TypeError("injected: s1's row breaks the sampler")
        return real_verify(sampler, logits, metadata, drafts)

    monkeypatch.setattr(step_sampler, "verify", verify)
    prompts = [[101, 2020, 3030, 4040], [5050, 6060, 7070], [8080, 9090, 1111, 1212, 1313]]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"s{i}", prompt_token_ids=prompt, sampling_params=SamplingParams(temperature=0, max_tokens=12))
    last, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            last[out.request_id] = out
        steps += 1
        if steps == 2:  # after the prefill and one verified step
            broken.append(engine.scheduler.requests["s1"].output_token_ids)
    assert last["s1"].finish_reason == "abort" and "TypeError" in last["s1"].error
    assert [(last[r].finish_reason, last[r].num_output_tokens) for r in ("s0", "s2")] == [("length", 12)] * 2
    assert_idle(engine)
