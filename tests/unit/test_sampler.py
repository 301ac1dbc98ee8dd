"""Sampler: greedy, seeded sampling, truncation, penalties, min_tokens, logit_bias, logprobs.

Every test runs with both draws of random rows: the exponential race (torch; CUDA, or CPU without
Carpool's kernels) and the inversion kernel (``carpool_cpu::sample_rows``, CPU). The sampler's
inputs are built as the engine builds them: the requests take seats of a persistent
:class:`SamplingBatch`, which gathers their :class:`SamplingMetadata` (and keeps a seeded
request's generator across calls, as across a preemption)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from replica.core.request import Request
from replica.protocol.sampling_params import SamplingParams
from replica.sample import sampler as sampler_module
from replica.sample.logits_processors import (
    apply_logit_bias,
    apply_min_p,
    apply_min_tokens,
    apply_penalties,
    apply_top_k_top_p,
)
from replica.sample.metadata import SamplingMetadata
from replica.sample.sampler import Sampler
from replica.worker.sampling_batch import SamplingBatch

VOCAB = 64
EOS = 2


_ids = itertools.count()


def make_request(prompt=(5, 6, 7), output=(), eos=(EOS,), **params) -> Request:
    return Request(
        request_id=f"r{next(_ids)}",
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(**params),
        eos_token_ids=tuple(eos),
        output_token_ids=list(output),
    )


_seats = SamplingBatch(8192)


def metadata_of(requests: list[Request]) -> SamplingMetadata:
    """The requests' metadata, gathered from seats ``0..n-1``, which are freed again; the requests
    are ``WAITING``, so a seeded one keeps its generator for the next call (as when preempted)."""
    for seat, request in enumerate(requests):
        _seats.add(seat, request)
    try:
        return _seats.gather(np.arange(len(requests)))
    finally:
        for seat in range(len(requests)):
            _seats.remove(seat)


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


_sampler = Sampler()


def sampler(logits: torch.Tensor, requests: list[Request]):
    return _sampler(logits, metadata_of(requests))


@pytest.fixture(autouse=True, params=["race", "inversion"])
def draw(request, monkeypatch) -> str:
    """How random rows are drawn: torch's exponential race, or Carpool's CPU inversion kernel."""
    if request.param == "race":
        monkeypatch.setattr(sampler_module, "cpu_inversion", lambda: False)
    elif not sampler_module.cpu_inversion():
        pytest.skip("Carpool's CPU kernels could not be built (no C++ compiler)")
    return request.param


def inversion(probs: torch.Tensor, u: float) -> int:
    """The reference draw by inversion: the first token whose running sum of ``probs`` (float64)
    exceeds ``u`` times their total."""
    cumulative = probs.double().cumsum(-1)
    return int(torch.searchsorted(cumulative, u * cumulative[-1], right=True))


def test_greedy_is_argmax_and_input_untouched():
    logits = random_logits(8)
    before = logits.clone()
    out = sampler(logits, [make_request(temperature=0.0) for _ in range(8)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 8
    assert torch.equal(logits, before)


def test_greedy_bfloat16_logits():
    logits = random_logits(4).to(torch.bfloat16)
    out = sampler(logits, [make_request(temperature=0.0) for _ in range(4)])
    assert out.token_ids == logits.float().argmax(dim=-1).tolist()


def test_greedy_with_repetition_penalty_matches_transformers():
    logits = random_logits(3, scale=1.0)
    prompts = [[1, 4, 9], [int(logits[1].argmax()), 3], [int(logits[2].argmax())]]
    outputs = [[10, 11], [], [int(logits[2].topk(2).indices[1])]]
    reqs = [make_request(prompt=p, output=o, temperature=0.0, repetition_penalty=1.7) for p, o in zip(prompts, outputs)]
    ours = sampler(logits, reqs).token_ids
    processor = RepetitionPenaltyLogitsProcessor(penalty=1.7)
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        hf_scores = processor(torch.tensor([p + o]), logits[i : i + 1].clone())
        assert ours[i] == int(hf_scores.argmax())


def draw_sequence(seed: int, position: int, batch_size: int, steps: int = 24) -> list[int]:
    """Sample ``steps`` times for one seeded request placed at ``position`` among others."""
    target = make_request(seed=seed, temperature=1.0, top_p=0.95)
    others = [make_request(temperature=0.8) if j % 2 else make_request(seed=1000 + j) for j in range(batch_size - 1)]
    tokens = []
    for step in range(steps):
        logits = random_logits(batch_size, seed=step, scale=1.0)  # flat-ish: many likely tokens
        reqs = others[:position] + [target] + others[position:]
        # the target's row must see the same logits whatever its position
        target_row = random_logits(1, seed=10_000 + step, scale=1.0)[0]
        logits[position] = target_row
        tokens.append(sampler(logits, reqs).token_ids[position])
    return tokens


def test_seeded_samples_do_not_depend_on_batch_mates():
    alone = draw_sequence(seed=42, position=0, batch_size=1)
    assert draw_sequence(seed=42, position=0, batch_size=5) == alone
    assert draw_sequence(seed=42, position=3, batch_size=7) == alone
    assert draw_sequence(seed=42, position=6, batch_size=7) == alone


def test_seeded_row_draws_from_its_own_generator(draw):
    logits = random_logits(3, scale=1.0)
    reqs = [make_request(), make_request(seed=123, temperature=0.7), make_request(seed=5)]
    token = sampler(logits, reqs).token_ids[1]
    probs = (logits[1] / 0.7).softmax(-1)
    own = torch.Generator().manual_seed(123)
    if draw == "race":
        noise = torch.empty(VOCAB).exponential_(generator=own)
        assert token == int((probs / noise).argmax())
    else:
        assert token == inversion(probs, float(torch.rand(1, dtype=torch.float64, generator=own)))


def test_different_seeds_differ():
    assert draw_sequence(seed=1, position=0, batch_size=1) != draw_sequence(seed=2, position=0, batch_size=1)


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = random_logits(16, scale=1.0)
    greedy = logits.argmax(dim=-1).tolist()
    assert sampler(logits, [make_request(top_k=1) for _ in range(16)]).token_ids == greedy
    assert sampler(logits, [make_request(top_p=1e-6) for _ in range(16)]).token_ids == greedy
    assert sampler(logits, [make_request(min_p=1.0) for _ in range(16)]).token_ids == greedy
    mixed = [make_request(top_k=1), make_request(top_p=1e-6, seed=3), make_request(temperature=0.0)] * 5
    mixed.append(make_request(top_k=1))
    assert sampler(logits, mixed).token_ids == greedy


@pytest.mark.parametrize("top_k,top_p", [(5, None), (None, 0.6), (7, 0.8), (3, 0.99)])
def test_top_k_top_p_match_transformers_warpers(top_k, top_p):
    logits = random_logits(6, scale=2.0)
    expected = logits.clone()
    if top_k is not None:
        expected = TopKLogitsWarper(top_k=top_k)(None, expected)
    if top_p is not None:
        expected = TopPLogitsWarper(top_p=top_p)(None, expected)
    k = torch.full((6,), top_k, dtype=torch.long) if top_k is not None else None
    p = torch.full((6,), top_p) if top_p is not None else None
    ours = apply_top_k_top_p(logits, k, p)
    assert torch.equal(torch.isinf(ours), torch.isinf(expected))
    kept = ~torch.isinf(ours)
    assert torch.equal(ours[kept], logits[kept])


@pytest.mark.parametrize("candidates", [1024, 8])  # nucleus found among candidates / sort fallback
def test_top_p_mixed_rows_match_transformers(monkeypatch, candidates):
    import replica.sample.logits_processors as logits_processors

    monkeypatch.setattr(logits_processors, "TOP_P_CANDIDATES", candidates)
    vocab = 2000
    logits = torch.cat([random_logits(4, vocab, seed=1, scale=4.0), random_logits(4, vocab, seed=2, scale=0.3)])
    top_k = torch.tensor([vocab, 10, vocab, 300, vocab, 10, vocab, 1500])  # vocab = disabled
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.95, 0.9, 1.0, 0.2, 0.99])
    ours = apply_top_k_top_p(logits, top_k, top_p)
    for i in range(8):
        expected = logits[i : i + 1].clone()
        if top_k[i] < vocab:
            expected = TopKLogitsWarper(top_k=int(top_k[i]))(None, expected)
        if top_p[i] < 1:
            expected = TopPLogitsWarper(top_p=float(top_p[i]))(None, expected)
        assert torch.equal(torch.isinf(ours[i : i + 1]), torch.isinf(expected)), i
    assert not torch.isinf(ours[2]).logical_not().all()  # something was cut


def test_top_p_keeps_smallest_nucleus():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept = lambda p: (~torch.isinf(apply_top_k_top_p(logits, None, torch.tensor([p])))).nonzero()[:, 1].tolist()
    assert kept(0.4) == [0]
    assert kept(0.7) == [0, 1]
    assert kept(0.9) == [0, 1, 2]
    assert kept(1.0) == [0, 1, 2, 3]


def test_min_p_threshold_and_matches_transformers():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept = (~torch.isinf(apply_min_p(logits, torch.tensor([0.2])))).nonzero()[:, 1].tolist()
    assert kept == [0, 1, 2]  # 0.05 < 0.2 * 0.5
    many = random_logits(5)
    ours = apply_min_p(many, torch.full((5,), 0.1))
    theirs = MinPLogitsWarper(min_p=0.1)(None, many.clone())
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    # min_p = 0 disables
    assert torch.equal(apply_min_p(many, torch.zeros(5)), many)


def test_samples_follow_the_distribution_and_respect_truncation():
    n = 4000
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(n, 4).contiguous()
    torch.manual_seed(0)
    counts = torch.bincount(torch.tensor(sampler(logits, [make_request() for _ in range(n)]).token_ids), minlength=4)
    assert torch.allclose(counts / n, probs, atol=0.03)
    # temperature 0.5 squares the probabilities (renormalized)
    tokens = sampler(logits, [make_request(temperature=0.5) for _ in range(n)]).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=4)
    assert torch.allclose(counts / n, probs**2 / (probs**2).sum(), atol=0.03)
    # truncation: never outside the kept set
    assert set(sampler(logits, [make_request(top_k=2) for _ in range(n)]).token_ids) == {0, 1}
    assert set(sampler(logits, [make_request(top_p=0.7) for _ in range(n)]).token_ids) == {0, 1}
    assert set(sampler(logits, [make_request(min_p=0.2) for _ in range(n)]).token_ids) == {0, 1, 2}


def test_apply_penalties_changes_exactly_the_expected_logits():
    logits = torch.tensor(
        [
            [1.0, -1.0, 2.0, -2.0, 0.5, 3.0],  # repetition only
            [1.0, -1.0, 2.0, -2.0, 0.5, 3.0],  # no penalty
            [1.0, -1.0, 2.0, -2.0, 0.5, 3.0],  # frequency + presence
            [1.0, -1.0, 2.0, -2.0, 0.5, 3.0],  # all three
        ]
    )
    reqs = [
        make_request(prompt=[0, 1], output=[1, 3], repetition_penalty=2.0),
        make_request(prompt=[0, 1], output=[1, 3]),
        make_request(prompt=[0, 1], output=[2, 2, 4], frequency_penalty=0.5, presence_penalty=0.25),
        make_request(
            prompt=[5], output=[2, 2, 1], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=-1.0
        ),
    ]
    out = apply_penalties(logits.clone(), metadata_of(reqs))
    expected = torch.tensor(
        [
            [0.5, -2.0, 2.0, -4.0, 0.5, 3.0],  # tokens 0, 1, 3 seen (prompt + output)
            [1.0, -1.0, 2.0, -2.0, 0.5, 3.0],
            # token 2 twice: 2 - 0.5*2 - 0.25; token 4 once: 0.5 - 0.5 - 0.25; prompt tokens untouched
            [1.0, -1.0, 0.75, -2.0, -0.25, 3.0],
            # repetition on 1, 2, 5 (prompt 5 too); then frequency/presence on output 2 (x2), 1 (x1)
            [1.0, -2.0 - 0.5 + 1.0, 1.0 - 1.0 + 1.0, -2.0, 0.5, 1.5],
        ]
    )
    assert torch.allclose(out, expected)


def test_min_tokens_masks_eos_and_stop_token_ids():
    logits = torch.zeros(5, VOCAB)
    logits[:, EOS] = 10.0
    logits[:, 9] = 9.0  # a stop token id, second best
    logits[:, 4] = 8.0
    reqs = [
        make_request(temperature=0.0, min_tokens=3, output=[7]),  # EOS masked
        make_request(temperature=0.0, min_tokens=3, output=[7, 7, 7]),  # reached: EOS allowed
        make_request(temperature=0.0, min_tokens=3, stop_token_ids=[9]),  # EOS and 9 masked
        make_request(temperature=0.0, min_tokens=3, ignore_eos=True, stop_token_ids=[9]),  # EOS kept
        make_request(temperature=0.0, min_tokens=3, stop_token_ids=[9], seed=0, top_k=1),  # random row too
    ]
    out = sampler(logits, reqs)
    assert out.token_ids == [9, EOS, 4, EOS, 4]
    masked = apply_min_tokens(logits.clone(), metadata_of(reqs))
    assert math.isinf(masked[0, EOS]) and not math.isinf(masked[1, EOS]) and not math.isinf(masked[3, EOS])
    assert math.isinf(masked[2, 9]) and math.isinf(masked[3, 9])


def test_logprobs_from_raw_logits():
    logits = random_logits(4)
    reqs = [
        make_request(logprobs=5, temperature=0.0),
        make_request(logprobs=0, temperature=0.7, repetition_penalty=1.5, seed=1),  # raw, not penalized
        make_request(),  # no logprobs
        make_request(logprobs=3, top_k=4, seed=9),
    ]
    out = sampler(logits, reqs)
    reference = logits.log_softmax(dim=-1)
    assert out.logprobs[2] is None
    for i in (0, 1, 3):
        lp = out.logprobs[i]
        token = out.token_ids[i]
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(float(reference[i, token]), abs=1e-6)
        assert lp.rank == int((reference[i] > reference[i, token]).sum()) + 1
        k = reqs[i].sampling_params.logprobs
        assert len(lp.top) == k
        best = reference[i].topk(max(k, 1))
        assert [t for t, _ in lp.top] == best.indices.tolist()[:k]
        assert [v for _, v in lp.top] == pytest.approx(best.values.tolist()[:k], abs=1e-6)
        assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:]))
    assert out.logprobs[0].rank == 1  # greedy without penalties picks the most likely token


# ---- logit_bias -----------------------------------------------------------------------------------


def test_apply_logit_bias_adds_exactly_the_biases():
    logits = random_logits(3)
    reqs = [
        make_request(logit_bias={4: 2.5, 9: -100}),
        make_request(),  # no bias: untouched
        make_request(logit_bias={0: 100, 63: -1.0}),
    ]
    out = apply_logit_bias(logits.clone(), metadata_of(reqs))
    expected = logits.clone()
    expected[0, 4] += 2.5
    expected[0, 9] -= 100
    expected[2, 0] += 100
    expected[2, 63] -= 1.0
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logit_bias_changes_the_greedy_argmax_and_logprobs_stay_raw(dtype):
    logits = random_logits(3).to(dtype)
    before = logits.clone()
    least = [int(i) for i in logits.float().argmin(dim=-1)]
    best = [int(i) for i in logits.float().argmax(dim=-1)]
    second = [int(i) for i in logits.float().topk(2, dim=-1).indices[:, 1]]
    reqs = [
        make_request(temperature=0.0, logit_bias={least[0]: 100}, logprobs=2),  # forced to the least likely
        make_request(temperature=0.0, logit_bias={best[1]: -100}),  # the best is banned
        make_request(temperature=0.0),
    ]
    out = sampler(logits, reqs)
    assert out.token_ids == [least[0], second[1], best[2]]
    assert torch.equal(logits, before)  # input untouched
    # Logprobs are those of the raw logits, as vLLM reports them: the forced token is unlikely there.
    reference = logits.float().log_softmax(dim=-1)
    lp = out.logprobs[0]
    assert lp.token_id == least[0]
    assert lp.logprob == pytest.approx(float(reference[0, least[0]]), abs=1e-6)
    assert lp.rank == VOCAB
    assert [t for t, _ in lp.top] == reference[0].topk(2).indices.tolist()
    # A batch of only greedy rows (the all-greedy fast path otherwise) still applies the bias.
    assert sampler(logits[1:2], [reqs[1]]).token_ids == [second[1]]
    assert sampler(logits[1:], reqs[1:]).token_ids == [second[1], best[2]]


def test_logit_bias_minus_100_bans_and_plus_100_forces_in_random_sampling():
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 5.0  # p(7) is about 0.7 without a bias
    banned = make_request(temperature=1.0, seed=1, logit_bias={7: -100})
    forced = make_request(temperature=1.0, seed=2, logit_bias={40: 100})
    plain = make_request(temperature=1.0, seed=3)
    draws = {"banned": [], "forced": [], "plain": []}
    for _ in range(300):  # each call advances the requests' own generators
        out = sampler(logits, [banned]).token_ids + sampler(logits, [forced]).token_ids + sampler(logits, [plain]).token_ids
        for name, token in zip(draws, out):
            draws[name].append(token)
    assert 7 not in draws["banned"]
    assert len(set(draws["banned"])) > 20  # the rest of the distribution is still sampled
    assert set(draws["forced"]) == {40}
    assert draws["plain"].count(7) > 150  # sanity: without the bias 7 is the usual draw


def test_logit_bias_rows_leave_their_batch_mates_unchanged():
    """Rows without a bias get the same tokens in a batch with biased rows as alone, and as in the
    same batch without the biases (unseeded rows: the same default-generator draws)."""
    logits = random_logits(7, scale=2.0)

    def batch(with_bias: bool) -> list[Request]:
        bias = (lambda b: b) if with_bias else (lambda b: None)
        return [
            make_request(temperature=0.0),
            make_request(temperature=0.8, seed=5, top_k=10, top_p=0.9),
            make_request(temperature=0.0, logit_bias=bias({int(logits[2].argmax()): -100, 3: 4.0})),
            make_request(temperature=1.0),  # unseeded
            make_request(temperature=0.0, repetition_penalty=1.3, output=[1, 2]),
            make_request(temperature=1.2, seed=8, logit_bias=bias({11: 100})),
            make_request(temperature=0.7, seed=9, min_p=0.1, logprobs=3),
        ]

    torch.manual_seed(1234)
    biased = sampler(logits, batch(True))
    torch.manual_seed(1234)
    unbiased = sampler(logits, batch(False))
    neighbours = [0, 1, 3, 4, 6]
    assert [biased.token_ids[i] for i in neighbours] == [unbiased.token_ids[i] for i in neighbours]
    assert biased.token_ids[5] == 11 and biased.token_ids[2] != unbiased.token_ids[2]
    assert biased.logprobs[6] == unbiased.logprobs[6]
    for i in (0, 1, 4, 6):  # deterministic rows, alone
        assert sampler(logits[i : i + 1], [batch(False)[i]]).token_ids == [biased.token_ids[i]]
    # An all-greedy bf16 batch: the unbiased rows keep the fast path's tokens.
    half = logits.to(torch.bfloat16)
    fast = sampler(half, [make_request(temperature=0.0) for _ in range(7)]).token_ids
    mixed = sampler(half, [make_request(temperature=0.0, logit_bias={0: 50} if i == 3 else None) for i in range(7)])
    assert [t for i, t in enumerate(mixed.token_ids) if i != 3] == [t for i, t in enumerate(fast) if i != 3]
    assert mixed.token_ids[3] == 0


@pytest.mark.parametrize(
    "bias",
    [
        {"5": 1.0},  # keys are ints (the API parses the strings)
        {True: 1.0},
        {-1: 1.0},
        {2.0: 1.0},
        {5: 100.5},
        {5: -101},
        {5: float("nan")},
        {5: float("inf")},
        {5: "1"},
        {5: True},
        {5: None},
        [(5, 1.0)],
        {i: 1.0 for i in range(1025)},
    ],
)
def test_logit_bias_validation(bias):
    with pytest.raises(ValueError, match=r"^logit_bias"):
        SamplingParams(logit_bias=bias)


def test_logit_bias_valid_values():
    params = SamplingParams(logit_bias={5: 100, 6: -100, 7: 0.25})
    assert params.logit_bias == {5: 100.0, 6: -100.0, 7: 0.25}
    assert all(isinstance(v, float) for v in params.logit_bias.values())
    assert SamplingParams(logit_bias={i: -1 for i in range(1024)}).logit_bias[1023] == -1.0
    assert SamplingParams(logit_bias={}).logit_bias == {}
    assert SamplingParams().logit_bias is None


def test_bf16_logprobs_come_from_the_raw_logits_when_every_row_is_random():
    """The float32 copy of bf16 logits is sampled in place only when no row needs it raw."""
    logits = random_logits(3, scale=2.0).bfloat16()
    reqs = [make_request(temperature=0.5, logprobs=2, seed=1), make_request(temperature=0.7, seed=2), make_request(temperature=1.3)]
    out = sampler(logits, reqs)
    expected = torch.log_softmax(logits[0].float(), -1)
    entry = out.logprobs[0]
    assert entry is not None
    assert math.isclose(entry.logprob, float(expected[out.token_ids[0]]), rel_tol=1e-6, abs_tol=1e-6)
    assert out.logprobs[1] is None and out.logprobs[2] is None


def test_a_logit_at_plus_infinity_takes_the_row_and_banned_tokens_stay_banned():
    logits = torch.zeros(2, VOCAB)
    logits[:, 0] = float("-inf")  # banned (as min_tokens bans EOS)
    logits[0, 9] = float("inf")  # overflowed (e.g. a tiny repetition penalty)
    tokens = sampler(logits, [make_request(seed=1), make_request(seed=2)]).token_ids
    assert tokens[0] == 9
    assert tokens[1] != 0
