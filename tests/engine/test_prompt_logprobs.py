"""Prompt logprobs (``SamplingParams.prompt_logprobs``) and prompt-only requests (``max_tokens=0``).

Each prompt token's logprob must equal a transformers forward over the same ids (fp32) in every
scheduling situation that splits or repeats a prefill: alone, batched, chunked, preempted, under
both policies, compiled and eager. Requests that do not ask keep their exact tokens.
"""

from __future__ import annotations

import random

import pytest
import torch

from replica import LLM, SamplingParams
from tests.helpers import ON_TEST_DEVICE, TEST_DEVICE, assert_idle

pytestmark = pytest.mark.timeout(300)

K = 3  # top alternatives asked for


def _prompts(seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in (1, 2, 9, 17, 33, 40, 64, 71)]


PROMPTS = _prompts()
_reference: dict[str, list[torch.Tensor]] = {}


def reference(path: str) -> list[torch.Tensor]:
    """transformers' fp32 log-softmax over each prompt, ``[len(prompt), V]`` (row ``q`` scores token ``q + 1``)."""
    if path not in _reference:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").to(TEST_DEVICE)
        with torch.no_grad():
            _reference[path] = [model(torch.tensor([ids], device=TEST_DEVICE)).logits[0].float().log_softmax(-1).cpu() for ids in PROMPTS]
    return _reference[path]


def assert_matches_reference(prompt: list[int], entries, ref: torch.Tensor) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for q, entry in enumerate(entries[1:]):
        row = ref[q]
        target = prompt[q + 1]
        assert entry.token_id == target
        assert entry.logprob == pytest.approx(row[target].item(), abs=1e-4)
        # The rank, up to tokens within float rounding (1e-4) of the target's logprob.
        assert int((row > row[target] + 1e-4).sum()) + 1 <= entry.rank <= int((row > row[target] - 1e-4).sum()) + 1
        top = row.topk(K)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)


SCENARIOS = {
    "alone-batched": dict(max_num_seqs=8),
    "chunked": dict(max_num_seqs=8, max_num_batched_tokens=16),
    # 8 blocks of 16 tokens for 8 prompts of up to 71 tokens plus 20 outputs: preemption by recompute.
    "preempted": dict(max_num_seqs=8, num_blocks=8, max_model_len=128),
}


@pytest.mark.parametrize("variant", [("auto", True), ("reference", False)], ids=["fast-compiled", "reference-eager"])
@pytest.mark.parametrize("policy", ["continuous", "static"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_prompt_logprobs_equal_a_transformers_forward(tiny_llama, scenario, policy, variant):
    backend, compile_ = variant
    llm = LLM(
        model=tiny_llama, dtype="float32", **ON_TEST_DEVICE, block_size=16, batching_policy=policy,
        attention_backend=backend, compile=compile_, **SCENARIOS[scenario],
    )
    # Every other request asks; the rest are its neighbours. Outputs long enough to overlap.
    params = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=K if i % 2 == 0 else None)
        for i in range(len(PROMPTS))
    ]
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    alone = llm.generate(prompt_token_ids=PROMPTS, sampling_params=[SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * len(PROMPTS))
    ref = reference(tiny_llama)
    for i, (out, base) in enumerate(zip(outs, alone)):
        assert out.outputs[0].token_ids == base.outputs[0].token_ids  # asking changes no token
        if i % 2 == 0:
            assert_matches_reference(PROMPTS[i], out.prompt_logprobs, ref[i])
        else:
            assert out.prompt_logprobs is None
    if scenario == "preempted":
        assert llm.engine.scheduler.num_preemptions > 0
    assert_idle(llm.engine)


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(model=tiny_llama, dtype="float32", **ON_TEST_DEVICE, max_num_seqs=4, block_size=16, num_blocks=32, max_num_batched_tokens=24)


def test_max_tokens_zero_scores_the_prompt_only(llm, tiny_llama):
    """``max_tokens=0``: the prompt is prefilled (in chunks) and scored, no token is generated,
    the request ends with ``length`` and frees its blocks; its neighbours go on unchanged."""
    params = [SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=K), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    scored, neighbour = llm.generate(prompt_token_ids=[PROMPTS[6], PROMPTS[5]], sampling_params=params)
    [alone] = llm.generate(prompt_token_ids=[PROMPTS[5]], sampling_params=params[1])
    c = scored.outputs[0]
    assert (c.token_ids, c.text, c.finish_reason) == ([], "", "length")
    assert_matches_reference(PROMPTS[6], scored.prompt_logprobs, reference(tiny_llama)[6])
    assert neighbour.outputs[0].token_ids == alone.outputs[0].token_ids
    [plain] = llm.generate(prompt_token_ids=[PROMPTS[3]], sampling_params=SamplingParams(max_tokens=0))
    assert plain.outputs[0].token_ids == [] and plain.prompt_logprobs is None
    assert_idle(llm.engine)


def test_n_choices_each_get_the_prompt_logprobs(llm, tiny_llama):
    [out] = llm.generate(prompt_token_ids=[PROMPTS[4]], sampling_params=SamplingParams(n=2, seed=1, max_tokens=3, prompt_logprobs=K))
    assert len(out.outputs) == 2
    assert_matches_reference(PROMPTS[4], out.prompt_logprobs, reference(tiny_llama)[4])
    assert_idle(llm.engine)


def test_step_outputs_carry_prompt_logprobs_once(llm):
    """The first delta of a request holds its prompt logprobs whole; later deltas hold none."""
    engine = llm.engine
    request = engine.add_request(None, prompt_token_ids=PROMPTS[7], sampling_params=SamplingParams(max_tokens=4, prompt_logprobs=0, ignore_eos=True))
    deltas = []
    while engine.has_unfinished_requests():
        deltas += [d for d in engine.step() if d.request_id == request.request_id]
    assert [d.prompt_logprobs is not None for d in deltas] == [True, False, False, False]
    assert len(deltas[0].prompt_logprobs) == len(PROMPTS[7]) and all(e.top == [] for e in deltas[0].prompt_logprobs[1:])
    assert_idle(engine)


@pytest.mark.parametrize(
    "field, value, message",
    [("prompt_logprobs", 21, r"^prompt_logprobs must be in \[0, 20\]"), ("prompt_logprobs", -1, r"^prompt_logprobs"), ("max_tokens", -1, r"^max_tokens must be at least 0")],
)
def test_bad_prompt_logprobs_parameters(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_a_prompt_of_max_model_len_tokens_can_be_scored(tiny_llama):
    """Scoring generates nothing, so a prompt may fill the whole context; generating needs a slot."""
    llm = LLM(model=tiny_llama, dtype="float32", **ON_TEST_DEVICE, block_size=16, num_blocks=8, max_model_len=64, max_num_batched_tokens=24)
    prompt = (PROMPTS[7] * 2)[:64]
    [out] = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert len(out.prompt_logprobs) == 64 and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="maximum context length is 64 tokens; the prompt has 64 tokens"):
        llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=1))
    assert_idle(llm.engine)
