"""Async scheduling (``async_scheduling=True``): step N+1 is scheduled and launched before step N's
tokens are read, and decode rows take their input token from step N's device tensor.

A request's tokens must not change: greedy ones equal transformers ``generate`` in every scheduling
scenario, and every sampling option (seeded sampling, penalties, stops, logprobs, prompt logprobs,
structured output, prefix caching, aborts) gives what the synchronous engine gives. On CPU every op
is synchronous, so these tests check the bookkeeping; the overlap itself shows on CUDA
(tests/gpu/device_check.sh runs this file there).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from replica import LLM, SamplingParams
from replica.protocol.constraints import DEAD_END, StructuredOutputsParams
from replica.sample.grammar import forbidden_tokens
from tests.engine.test_cuda_graphs import graph_engine
from tests.engine.test_fidelity import SCENARIOS, WORKLOAD, assert_reference_outputs, reference_tokens, run_engine
from tests.helpers import ON_TEST_DEVICE, TEST_DEVICE, assert_idle

# Module constants: reference_tokens caches by the workload's id().
FIVE_TOKENS = [([5, 6, 7, 8], 5)]
FORTY_TOKENS = [(ids, 40) for ids, _ in WORKLOAD[:4]]


@pytest.mark.parametrize("compile_", [True, False], ids=["compiled", "eager"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_matches_transformers_generate(tiny_llama, scenario, compile_):
    kwargs, plan = SCENARIOS[scenario]
    llm = LLM(model=tiny_llama, dtype="float32", **ON_TEST_DEVICE, async_scheduling=True, compile=compile_, **kwargs)
    assert llm.engine.async_scheduling
    got, reasons = run_engine(llm, WORKLOAD, plan)
    assert_reference_outputs(got, reasons, reference_tokens(tiny_llama, WORKLOAD))
    if scenario == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    assert_idle(llm.engine)


@pytest.mark.parametrize("scenario", ["few-seats", "preemption"])
def test_decode_graph_steps_take_their_input_tokens_from_the_step_in_flight(tiny_llama, scenario):
    """Decode-only steps through :class:`~replica.worker.cuda_graphs.DecodeGraphs` (captured on CUDA, the
    same static buffers uncaptured elsewhere) get the in-flight tokens written into their buffer."""
    kwargs, plan = SCENARIOS[scenario]
    llm = graph_engine(tiny_llama, async_scheduling=True, **kwargs)
    got, _ = run_engine(llm, WORKLOAD, plan)
    assert got == reference_tokens(tiny_llama, WORKLOAD)
    assert llm.engine.runner.graphs.steps_run > 0
    assert_idle(llm.engine)


def test_a_step_outputs_come_out_of_the_next_call_and_a_length_end_costs_no_row(tiny_llama):
    """With async scheduling each call returns the previous step's tokens; a request whose next
    token is sure to be its last (max_tokens) is not scheduled again, so 5 tokens take 5 forwards
    (and 6 calls); without it, 5 calls."""
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    for overlap, calls_expected in ((True, 6), (False, 5)):
        llm = LLM(model=tiny_llama, dtype="float32", **ON_TEST_DEVICE, max_num_seqs=4, async_scheduling=overlap)
        engine = llm.engine
        request = engine.add_request(prompt_token_ids=[5, 6, 7, 8], sampling_params=params)
        per_call = []
        while engine.has_unfinished_requests():
            per_call.append([t for out in engine.step() for t in out.new_token_ids])
        assert len(per_call) == calls_expected and engine.scheduler.step_count == 5
        if overlap:
            assert per_call[0] == [] and all(len(tokens) == 1 for tokens in per_call[1:])
        assert [t for tokens in per_call for t in tokens] == request.output_token_ids
        assert request.output_token_ids == reference_tokens(tiny_llama, FIVE_TOKENS)[0]
        assert_idle(engine)


def test_a_length_end_frees_its_seat_for_the_same_step(tiny_llama):
    """A request whose pending token is sure to be its last gives its seat to a waiting request in
    the step scheduled while that token is computed: with lengths known in advance (ignore_eos),
    async scheduling takes exactly the steps of the synchronous engine, and each request ends in
    the same step."""
    prompts = [[random.Random(i).randrange(3, 49152) for _ in range(3 + 4 * i)] for i in range(7)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (1, 6, 3, 9, 2, 5, 4)]
    runs = {}
    for overlap in (False, True):
        llm = LLM(model=tiny_llama, dtype="float32", **ON_TEST_DEVICE, max_num_seqs=2, async_scheduling=overlap)
        engine = llm.engine
        requests = [engine.add_request(prompt_token_ids=p, sampling_params=sp) for p, sp in zip(prompts, params)]
        while engine.has_unfinished_requests():
            engine.step()
            assert engine.scheduler.num_seats_taken <= 2
        runs[overlap] = (engine.scheduler.step_count, [(r.finish_step, r.output_token_ids) for r in requests])
        assert_idle(engine)
    assert runs[True] == runs[False]


def test_stop_ends_are_dated_to_the_step_of_their_token(tiny_llama):
    """A request alone that ends on a stop token id or a stop string, read one step late, reports
    the step that computed that token as its ``finish_step`` (as without async scheduling)."""
    prompt = list(range(300, 320))
    runs = {}
    for overlap in (False, True):
        llm = LLM(model=tiny_llama, dtype="float32", **ON_TEST_DEVICE, max_num_seqs=4, async_scheduling=overlap)
        [free] = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        tokens = free.outputs[0].token_ids
        stops = [SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[tokens[5]]),
                 SamplingParams(temperature=0, max_tokens=20, stop=[llm.engine.tokenizer.decode(tokens[:6])[-2:]])]
        runs[overlap] = []
        for params in stops:  # (a stop costs async scheduling one thrown-away step: count from here)
            first = llm.engine.scheduler.step_count + 1
            [out] = llm.generate(prompt_token_ids=[prompt], sampling_params=params)
            assert out.outputs[0].finish_reason == "stop"
            runs[overlap].append((out.outputs[0].token_ids, out.metrics["finish_step"] - first))
    assert runs[True] == runs[False]


def test_a_prompt_scored_in_chunks_ends_on_its_last_chunk(tiny_llama):
    """``max_tokens=0`` with prompt logprobs, prefilled in chunks of 16: the request ends when its
    last chunk is read, not when the one before it is (the scheduler already counts the last
    chunk then), and gets every prompt position's logprobs."""
    prompt = list(range(100, 160))
    runs = {}
    for overlap in (False, True):
        llm = LLM(model=tiny_llama, dtype="float32", **ON_TEST_DEVICE, max_num_batched_tokens=16, async_scheduling=overlap)
        [out] = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=0, prompt_logprobs=1))
        assert len(out.prompt_logprobs) == 60 and out.outputs[0].token_ids == []
        runs[overlap] = (repr(out.prompt_logprobs), out.metrics["finish_step"])
        assert_idle(llm.engine)
    assert runs[True] == runs[False]


def _mixed_params(tokenizer, first_run: list[list[int]]) -> list[SamplingParams]:
    """One request each of: seeded sampling with top-p, penalties, min_tokens with a stop token
    id seen early, a stop string seen early, logprobs, prompt logprobs, a logit bias, n=2."""
    stop_id = first_run[2][3]
    stop_text = tokenizer.decode(first_run[3][:6])[-3:]
    return [
        SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=24),
        SamplingParams(temperature=0.7, seed=12, max_tokens=20, repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=30, min_tokens=2, stop_token_ids=[stop_id]),
        SamplingParams(temperature=0, max_tokens=30, stop=[stop_text]),
        SamplingParams(temperature=0.8, seed=13, max_tokens=12, logprobs=3),
        SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=2),
        SamplingParams(temperature=0, max_tokens=15, logit_bias={first_run[6][0]: -100}),
        SamplingParams(n=2, temperature=1.0, seed=14, max_tokens=16),
    ]


def _summary(outputs):
    return [
        [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs] + [o.prompt_logprobs]
        for o in outputs
    ]


def _split_floats(value):
    """``value`` with every float replaced by None, and the floats in order: (skeleton, floats)."""
    if isinstance(value, float):
        return None, [value]
    if dataclasses.is_dataclass(value):
        value = dataclasses.astuple(value)
    if isinstance(value, (list, tuple)):
        parts = [_split_floats(v) for v in value]
        return [p[0] for p in parts], [f for p in parts for f in p[1]]
    return value, []


def assert_same_outputs(overlapped, synchronous):
    """Equal on CPU. On CUDA, a thrown-away row changes a step's row count and cuBLAS picks its
    float32 kernels by shape, so logprob values may differ in their last bits (about 1e-7, seen on
    an H200); tokens, text, ranks and finish reasons must still be equal."""
    if TEST_DEVICE == "cpu":
        assert overlapped == synchronous
        return
    (shape_o, floats_o), (shape_s, floats_s) = _split_floats(overlapped), _split_floats(synchronous)
    assert shape_o == shape_s
    assert floats_o == pytest.approx(floats_s, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("seats", [3, 16])
def test_sampling_options_give_the_synchronous_engine_s_outputs(tiny_llama, seats):
    """Every option that reads the tokens so far (penalties, min_tokens, stops, seeded draws) gives
    the same tokens, text, logprobs and finish reasons as without async scheduling; with 3 seats
    requests also queue, and 20-token chunks split the prompts."""
    prompts = [[random.Random(i).randrange(3, 49152) for _ in range(9 + 7 * i)] for i in range(8)]
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engines = {
        overlap: LLM(model=tiny_llama, dtype="float32", **ON_TEST_DEVICE, max_num_seqs=seats,
                     max_num_batched_tokens=20, async_scheduling=overlap)
        for overlap in (False, True)
    }
    first = [o.outputs[0].token_ids for o in engines[False].generate(prompt_token_ids=prompts, sampling_params=greedy)]
    params = _mixed_params(engines[False].engine.tokenizer, first)
    results = {
        overlap: llm.generate(prompt_token_ids=prompts, sampling_params=params) for overlap, llm in engines.items()
    }
    assert_same_outputs(_summary(results[True]), _summary(results[False]))
    reasons = [c.finish_reason for o in results[True] for c in o.outputs]
    assert reasons[2] == "stop" and reasons[3] == "stop"  # ended one step before a row was thrown away
    for llm in engines.values():
        assert_idle(llm.engine)


def test_structured_output_and_prefix_cache_hits_on_generated_blocks(tiny_llama):
    """A regex constraint (its mask for step N+1 needs step N's token, which is read before step
    N+1 samples) and a prompt that is an earlier request's prompt and output (its cached blocks were
    registered a step late, once their last token was known) give the synchronous engine's tokens,
    the latter with prefix cache hits on the generated blocks."""
    outputs = {}
    for overlap in (False, True):
        llm = LLM(model=tiny_llama, dtype="float32", **ON_TEST_DEVICE, max_num_seqs=4, block_size=16,
                  async_scheduling=overlap)
        constrained = SamplingParams(temperature=0.9, seed=3, max_tokens=24, structured_outputs={"regex": "[0-9]{3}-[a-z]{2,4}"})
        [regex] = llm.generate(prompt_token_ids=[[7, 8, 9, 10]], sampling_params=constrained)
        prompt = [random.Random(5).randrange(3, 49152) for _ in range(20)]
        long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        [first] = llm.generate(prompt_token_ids=[prompt], sampling_params=long)
        hits = llm.engine.scheduler.prefix_cache_hits
        [second] = llm.generate(prompt_token_ids=[prompt + first.outputs[0].token_ids], sampling_params=long)
        assert llm.engine.scheduler.prefix_cache_hits - hits >= 48  # 3 full blocks, 2 of them generated
        outputs[overlap] = [regex.outputs[0].token_ids, regex.outputs[0].text, first.outputs[0].token_ids,
                            second.outputs[0].token_ids]
        assert_idle(llm.engine)
    assert outputs[True] == outputs[False]
    assert outputs[True][1][3] == "-"


@pytest.mark.parametrize("end", ["length", "stop"])
def test_a_request_s_end_leaves_the_synchronous_engine_s_blocks_cached(tiny_llama, end):
    """A 20-token prompt; its 48th token (position 47) fills block 3. A length end after 29 output
    tokens: the 48th token, computed in the request's last step, was still pending when that step
    was scheduled, and no later step registers its block; the end does, as the synchronous engine
    has, so a follow-up turn hits all 3 blocks. A stop end on that 48th token: async scheduling
    computes its K/V in the step in flight (the row is thrown away), which must not register the
    block (the step may yet fail): 2 blocks, as in the synchronous engine, which never computes it."""
    params = SamplingParams(temperature=0, max_tokens=29, ignore_eos=True)
    hits = {}
    for overlap in (False, True):
        llm = LLM(model=tiny_llama, dtype="float32", **ON_TEST_DEVICE, max_num_seqs=2, block_size=16,
                  async_scheduling=overlap)
        for seed in range(20):  # a prompt whose 28th greedy token does not come earlier
            prompt = [random.Random(seed).randrange(3, 49152) for _ in range(20)]
            [first] = llm.generate(prompt_token_ids=[prompt], sampling_params=params)
            output = first.outputs[0].token_ids
            if output[27] not in output[:27]:
                break
        else:
            pytest.fail("no prompt's 28th token was new")
        follow_up = prompt + output
        if end == "stop":
            stop = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[output[27]], ignore_eos=True)
            llm.engine.block_manager.reset_prefix_cache()
            [first] = llm.generate(prompt_token_ids=[prompt], sampling_params=stop)
            assert first.outputs[0].token_ids == output[:28] and first.outputs[0].finish_reason == "stop"
            follow_up = prompt + output[:28] + [7]
        before = llm.engine.scheduler.prefix_cache_hits
        llm.generate(prompt_token_ids=[follow_up], sampling_params=params)
        hits[overlap] = llm.engine.scheduler.prefix_cache_hits - before
        assert_idle(llm.engine)
    expected = 48 if end == "length" else 32
    assert hits == {False: expected, True: expected}


def test_a_structured_output_dead_end_ends_as_in_the_synchronous_engine(tiny_llama):
    """``min_tokens`` bans every token a choice allows first: the request ends with ``abort`` and
    DEAD_END after one token, found from the host's mask (no logits read back), its neighbour
    untouched, as in the synchronous engine."""
    outputs = {}
    for overlap in (False, True):
        llm = LLM(model=tiny_llama, dtype="float32", **ON_TEST_DEVICE, max_num_seqs=4, async_scheduling=overlap)
        so = StructuredOutputsParams(choice=["yes"])
        bitmask = torch.zeros(1, (llm.engine.vocab_size + 31) // 32, dtype=torch.int32)
        llm.engine.grammar_compiler.compile(so).fill_bitmask(bitmask, 0)
        allowed = (~forbidden_tokens(bitmask, llm.engine.vocab_size))[0].nonzero().flatten().tolist()
        dead = SamplingParams(temperature=0, max_tokens=8, min_tokens=1, stop_token_ids=allowed, structured_outputs=so)
        other = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        results = llm.generate(prompt_token_ids=[[5, 6, 7], [9, 10, 11]], sampling_params=[dead, other])
        outputs[overlap] = [(c.token_ids, c.finish_reason, c.stop_reason) for o in results for c in o.outputs]
        assert_idle(llm.engine)
    assert outputs[True] == outputs[False]
    [(tokens, reason, stop_reason), (_, other_reason, _)] = outputs[True]
    assert reason == "abort" and stop_reason == DEAD_END and len(tokens) == 1 and other_reason == "length"


def test_abort_while_a_step_is_in_flight(tiny_llama):
    """Aborting a request whose step is in flight ends it at once (seat and blocks free); the
    others' tokens do not change, and nothing is left over."""
    llm = LLM(model=tiny_llama, dtype="float32", **ON_TEST_DEVICE, max_num_seqs=4, async_scheduling=True)
    engine = llm.engine
    requests = [
        engine.add_request(prompt_token_ids=ids, sampling_params=SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        for ids, _ in FORTY_TOKENS
    ]
    for _ in range(3):
        engine.step()
    victim = requests[1]
    final = engine.abort(victim.request_id)
    assert final is not None and final.finish_reason == "abort"
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert victim.request_id not in {o.request_id for o in outputs}
    expected = reference_tokens(tiny_llama, FORTY_TOKENS)  # up to EOS; the requests ignore it
    for i in (0, 2, 3):
        assert len(requests[i].output_token_ids) == 40
        assert requests[i].output_token_ids[: len(expected[i])] == expected[i]
    assert_idle(engine)


def test_async_scheduling_is_on_by_default_on_cuda_only(tiny_llama):
    """As in vLLM, steps overlap by default where there is a device to overlap with (CUDA); on
    CPU every op is synchronous, so the default there is off. Either can be set."""
    by_default = LLM(model=tiny_llama, dtype="float32", **ON_TEST_DEVICE, max_num_seqs=4, compile=False)
    assert by_default.engine.async_scheduling is TEST_DEVICE.startswith("cuda")
    for wanted in (True, False):
        llm = LLM(model=tiny_llama, dtype="float32", **ON_TEST_DEVICE, max_num_seqs=4, compile=False,
                  async_scheduling=wanted)
        assert llm.engine.async_scheduling is wanted


def test_static_policy_runs_synchronously(tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32", **ON_TEST_DEVICE, max_num_seqs=4, batching_policy="static",
              async_scheduling=True)
    assert not llm.engine.async_scheduling


def test_a_failed_launch_or_a_broken_sampler_ends_only_its_requests(tiny_llama, monkeypatch):
    """As without async scheduling (tests/engine/test_failures.py): a forward that fails ends the
    requests of its step after the tokens of the step before it, which are still read; a request
    that breaks the sampler ends alone (its next row had no input token from it, and is thrown
    away); the others give their reference tokens and nothing is left over."""
    from tests.engine.test_failures import PROMPTS, greedy, run_all, tokens_of

    llm = LLM(model=tiny_llama, dtype="float32", device=TEST_DEVICE, max_num_seqs=3, block_size=16, num_blocks=32,
              max_model_len=128, async_scheduling=True)
    engine = llm.engine
    reference = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=greedy())]
    real_launch, calls = engine.runner.launch, []

    def launch(out, previous=None):
        calls.append(out.step)
        if len(calls) == 3:
            raise RuntimeError("injected forward failure")
        return real_launch(out, previous)

    monkeypatch.setattr(engine.runner, "launch", launch)
    for i, ids in enumerate(PROMPTS):  # 4 requests, 3 seats: f3 waits
        engine.add_request(f"f{i}", prompt_token_ids=ids, sampling_params=greedy())
    outputs = run_all(engine)
    for i in range(3):
        last = outputs[f"f{i}"][-1]
        assert last.finish_reason == "abort" and "injected forward failure" in last.error
        assert tokens_of(outputs[f"f{i}"]) == reference[i][:2]
    assert tokens_of(outputs["f3"]) == reference[3] and outputs["f3"][-1].error is None
    assert_idle(engine)

    for i, ids in enumerate(PROMPTS[:3]):
        engine.add_request(f"s{i}", prompt_token_ids=ids, sampling_params=greedy())
    engine.scheduler.requests["s1"].sampling_params.temperature = None  # its seat keeps a TypeError
    outputs = run_all(engine)
    assert tokens_of(outputs["s0"]) == reference[0] and tokens_of(outputs["s2"]) == reference[2]
    [failed] = outputs["s1"]
    assert failed.finish_reason == "abort" and "TypeError" in failed.error
    assert_idle(engine)
