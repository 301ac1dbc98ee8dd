"""Greedy fidelity: Carpool's tokens equal transformers ``generate`` on the same weights (fp32).

Every scheduling situation that could change a request's computation — all at once, staggered
arrivals, fewer seats than requests, a block pool small enough to force preemption, chunked
prefill — under both policies, on two model families, and on every way the engine can run a step:
each attention backend of the test device, compiled and eager.
"""

from __future__ import annotations

import random

import pytest
import torch

from replica import LLM, SamplingParams
from replica.attention.op import paged_attention_forward
from tests.engine.conftest import SLIDING_WINDOW
from tests.helpers import ON_TEST_DEVICE, TEST_DEVICE, assert_idle

NUM_PROMPTS = 16


def _workload(seed: int = 0) -> list[tuple[list[int], int]]:
    """16 (prompt ids, max_tokens) pairs of varied lengths: 1 to 90 prompt tokens, 1 to 40 outputs."""
    rng = random.Random(seed)
    lengths = [1, 2, 3, 5, 8, 13, 17, 21, 30, 33, 47, 50, 64, 71, 80, 90]
    rng.shuffle(lengths)
    return [
        ([rng.randrange(3, 49152) for _ in range(n)], rng.choice([1, 2, 7, 16, 25, 40]))
        for n in lengths
    ]


_reference_cache: dict[tuple[str, int], list[list[int]]] = {}


def reference_tokens(path: str, workload) -> list[list[int]]:
    """transformers' own greedy ``generate``, one prompt at a time (no padding)."""
    key = (path, id(workload))
    if key not in _reference_cache:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").to(TEST_DEVICE)
        outs = []
        for ids, max_tokens in workload:
            generated = model.generate(
                torch.tensor([ids], device=TEST_DEVICE),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=TEST_DEVICE),
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=2,
            )
            outs.append(generated[0, len(ids):].tolist())
        _reference_cache[key] = outs
    return _reference_cache[key]


WORKLOAD = _workload()

# (attention_backend, compile): the device's fast backend compiled (the default) and eager, and the
# reference backend (one SDPA call per sequence) compiled and eager.
ENGINE_VARIANTS = [("auto", True), ("auto", False), ("reference", True), ("reference", False)]
VARIANT_IDS = ["fast-compiled", "fast-eager", "reference-compiled", "reference-eager"]


@pytest.fixture(params=ENGINE_VARIANTS, ids=VARIANT_IDS)
def variant(request) -> dict:
    backend, compile_ = request.param
    return dict(attention_backend=backend, compile=compile_)

SCENARIOS = {
    # name: (engine kwargs, arrival plan)
    "all-at-once": (dict(max_num_seqs=32), None),
    "few-seats": (dict(max_num_seqs=4), None),
    "staggered": (dict(max_num_seqs=8), "staggered"),
    "chunked-prefill": (dict(max_num_seqs=8, max_num_batched_tokens=24), None),
    # 12 blocks of 16 tokens = 192 token slots for 16 requests of up to 130 tokens each.
    "preemption": (dict(max_num_seqs=16, num_blocks=12, max_model_len=192), None),
}


def run_engine(llm: LLM, workload, plan) -> tuple[list[list[int]], list[str]]:
    engine = llm.engine
    requests = [
        engine.make_request(None, prompt_token_ids=ids, sampling_params=SamplingParams(temperature=0, max_tokens=m))
        for ids, m in workload
    ]
    pending = list(requests)
    step = 0
    while pending or engine.has_unfinished_requests():
        if plan == "staggered":
            # One new request every other step: arrivals land mid-decode of earlier ones.
            if pending and step % 2 == 0:
                engine.add_prepared_request(pending.pop(0))
        else:
            while pending:
                engine.add_prepared_request(pending.pop(0))
        engine.step()
        step += 1
    return [r.output_token_ids for r in requests], [r.finish_reason.value for r in requests]


def assert_reference_outputs(got: list[list[int]], reasons: list[str], expected: list[list[int]]) -> None:
    """``got`` equals transformers' tokens, and each finish reason is the token-level one: EOS
    (id 2) → stop, else the max_tokens limit → length."""
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g == e, f"request {i} (prompt {len(WORKLOAD[i][0])} tokens) differs"
    for tokens, reason, (_, max_tokens) in zip(got, reasons, WORKLOAD):
        assert reason == ("stop" if tokens[-1] == 2 else "length")
        assert len(tokens) == max_tokens or tokens[-1] == 2


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("policy", ["continuous", "static"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_matches_transformers_generate(tiny_model_factory, family, policy, scenario, variant):
    path = tiny_model_factory(family)
    kwargs, plan = SCENARIOS[scenario]
    llm = LLM(model=path, dtype="float32", **ON_TEST_DEVICE, batching_policy=policy, **kwargs, **variant)
    got, reasons = run_engine(llm, WORKLOAD, plan)
    assert_reference_outputs(got, reasons, reference_tokens(path, WORKLOAD))
    if scenario == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    assert_idle(llm.engine)


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the decode path for prefill chunks is the CPU backend's")
@pytest.mark.parametrize("compile_", [True, False], ids=["compiled", "eager"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_small_prefill_chunks_as_decode_queries_match_sdpa(tiny_model_factory, family, compile_):
    """The CPU backend runs a prefill chunk as one decode query per token
    (``AttentionMetadata.decode_queries``; compiled, a step of such chunks and decodes stays in the
    decode graph); with that turned off every chunk goes through the padded SDPA call. Both give
    transformers' tokens, and each path really ran (the decode graph never asks the backend to
    plan; eager, the plan puts the chunks on the decode kernel or on SDPA)."""
    path = tiny_model_factory(family)
    expected = reference_tokens(path, WORKLOAD)
    for off in (True, False):
        llm = LLM(model=path, dtype="float32", **ON_TEST_DEVICE, max_num_seqs=8, max_num_batched_tokens=24, compile=compile_)
        backend = llm.engine.runner.backend
        if not backend.inline_chunk_pairs:
            pytest.skip("Carpool's CPU kernels are not built: prefill chunks always take SDPA")
        if off:
            backend.inline_chunk_pairs = 0
        on_sdpa = []
        plan = backend.plan

        def counting_plan(step):
            plan(step)
            on_sdpa.append(backend.prefill is not None)

        backend.plan = counting_plan
        got, _ = run_engine(llm, WORKLOAD, "staggered")
        assert got == expected, f"inline_chunk_pairs={backend.inline_chunk_pairs}"
        if off:
            assert sum(on_sdpa) > 20  # every step with a prefill chunk used SDPA
        else:
            # 24-token chunks over at most 90 tokens (2,160 pairs): none on SDPA; compiled, the
            # decode graph took every step without a plan.
            assert not any(on_sdpa) and (on_sdpa == [] or not compile_)
        assert_idle(llm.engine)


def test_third_family_qwen3(tiny_model_factory, variant):
    """Qwen3 (per-head q/k RMSNorm) through the same attention hook."""
    path = tiny_model_factory("qwen3")
    llm = LLM(model=path, dtype="float32", **ON_TEST_DEVICE, max_num_seqs=4, max_num_batched_tokens=32, **variant)
    expected = reference_tokens(path, WORKLOAD)
    got, _ = run_engine(llm, WORKLOAD, None)
    assert got == expected
    assert_idle(llm.engine)


@pytest.mark.parametrize("variant", [dict(attention_backend="auto", compile=True), dict(attention_backend="reference", compile=False)],
                         ids=["fast-compiled", "reference-eager"])
@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_a_sliding_window_model_is_served_within_its_window(tiny_model_factory, family, variant):
    """Mistral (every layer) and Gemma 3 (every other layer) attend through a sliding window,
    which Carpool's attention does not implement. Such a model is served with max_model_len up to
    the window (the default), where the window covers every sequence: the tokens equal
    transformers' (which applies the window). Past it, the engine refuses to start, and the
    attention hook refuses a window shorter than the layer's max_model_len."""
    path = tiny_model_factory(family)
    llm = LLM(model=path, dtype="float32", **ON_TEST_DEVICE, max_num_seqs=4, max_num_batched_tokens=32, **variant)
    assert llm.engine.max_model_len == SLIDING_WINDOW
    got, _ = run_engine(llm, WORKLOAD, None)
    assert got == reference_tokens(path, WORKLOAD)
    assert_idle(llm.engine)

    layer = next(m for m in llm.engine.runner.model.modules() if hasattr(m, "carpool_key_cache"))
    layer.carpool_max_model_len = SLIDING_WINDOW + 1
    empty = torch.empty(1, 1, 0, 16)
    with pytest.raises(NotImplementedError, match="sliding window"):
        paged_attention_forward(layer, empty, empty, empty, None, sliding_window=SLIDING_WINDOW)
    with pytest.raises(ValueError, match=f"sliding window of {SLIDING_WINDOW} tokens"):
        LLM(model=path, dtype="float32", **ON_TEST_DEVICE, num_blocks=32, max_model_len=SLIDING_WINDOW + 1)


def test_batch_invariance(tiny_llama, variant):
    """A request's greedy tokens are the same alone and in a batch of 16."""
    llm = LLM(model=tiny_llama, dtype="float32", **ON_TEST_DEVICE, max_num_seqs=16, **variant)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ids = [[random.Random(i).randrange(3, 49152) for _ in range(5 + 3 * i)] for i in range(16)]
    together = llm.generate(prompt_token_ids=ids, sampling_params=params)
    for i in (0, 7, 15):
        [alone] = llm.generate(prompt_token_ids=[ids[i]], sampling_params=params)
        assert alone.outputs[0].token_ids == together[i].outputs[0].token_ids
    assert_idle(llm.engine)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_decode_alone_gives_the_bits_it_gives_among_others(tiny_llama, variant, dtype):
    """After the same prefill (alone both times), a request's decode logprobs are bit-identical
    whether each decode step holds it alone or with 5 others. On CPU the linears are Carpool's
    kernels, which compute a row the same way whatever its batch: in float32 (where the kernel is
    not built, a step runs at least 4 rows, ``FLOAT32_MIN_ROWS``) on AVX2, torch's float32 linear
    gives 1 to 3 rows other bits than 4 or more, and seeded sampling over a flat distribution
    picked another token; in bf16, oneDNN's GEMM gives some rows other bits in other batches."""
    if TEST_DEVICE != "cpu":
        pytest.skip("CPU linears; on CUDA, decode graphs of other sizes may pick other GEMM kernels")
    from replica.kernels import cpu_kernels

    cpu_kernels.load()
    if dtype == "bfloat16" and not (cpu_kernels.has_bf16_gemv() or cpu_kernels.has_f32_gemv()):
        pytest.skip("bf16 linears on oneDNN (neither of Carpool's linear kernels is built)")
    llm = LLM(model=tiny_llama, dtype=dtype, **ON_TEST_DEVICE, max_num_seqs=8, **variant)
    engine = llm.engine
    if cpu_kernels.has_f32_gemv():  # the kernel, not the row floor, keeps the bits
        assert engine.runner.num_packed > 0 and engine.runner.min_rows == 1
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    prompt = [random.Random(99).randrange(3, 49152) for _ in range(21)]

    def decode_logprobs(mates: int) -> list:
        engine.add_request("solo", prompt_token_ids=prompt, sampling_params=params)
        logprobs = []
        for out in engine.step():  # the prefill, alone
            logprobs += out.new_logprobs or []
        for m in range(mates):
            engine.add_request(f"mate{m}", prompt_token_ids=prompt[: 5 + m], sampling_params=params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == "solo":
                    logprobs += out.new_logprobs or []
        return logprobs

    alone, among = decode_logprobs(0), decode_logprobs(5)
    assert len(alone) == 12
    assert alone == among
    assert_idle(engine)


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the CPU backend's kernel; CUDA's attention kernels differ with the split")
@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_prompts_bits_do_not_depend_on_its_chunks_or_a_cached_prefix(tiny_model_factory, dtype, compile_):
    """A prompt's attention is the same bits however it is split into chunks (the token budget,
    shared with other prefills, decides that) and whatever prefix of it was cached: every prompt
    token is a query of Carpool's decode kernel, whatever its chunk. So a request's greedy tokens
    and logprobs are the very same prefilled whole and alone, in chunks of 42 tokens, in chunks
    beside 4 other prompts, and again from the prefix cache. Prefill chunks on SDPA (the rule
    before) gave other bits with other chunk lengths, and this test failed in both dtypes."""
    from replica.kernels import cpu_kernels

    if not cpu_kernels.load():
        pytest.skip("Carpool's CPU kernels are not built: prefill chunks take SDPA")
    path = tiny_model_factory("qwen2")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (69, 86, 108, 173, 240)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)

    def outputs(done) -> list:
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in done]

    common = dict(model=path, dtype=dtype, **ON_TEST_DEVICE, compile=compile_, max_num_seqs=5, max_model_len=320)
    whole = LLM(**common, max_num_batched_tokens=512, enable_prefix_caching=False)
    alone = [outputs(whole.generate(prompt_token_ids=[p], sampling_params=params))[0] for p in prompts]
    assert_idle(whole.engine)
    del whole
    chunked = LLM(**common, max_num_batched_tokens=42, enable_prefix_caching=True)
    hits = chunked.engine.stats().prefix_cache_hits
    for i, p in enumerate(prompts):
        assert outputs(chunked.generate(prompt_token_ids=[p], sampling_params=params))[0] == alone[i], i
    assert chunked.engine.stats().prefix_cache_hits == hits  # distinct prompts: each was prefilled
    chunked.engine.scheduler.block_manager.reset_prefix_cache()
    assert outputs(chunked.generate(prompt_token_ids=prompts, sampling_params=params)) == alone  # chunks beside others
    assert chunked.engine.stats().prefix_cache_hits == hits
    assert outputs(chunked.generate(prompt_token_ids=prompts, sampling_params=params)) == alone  # from the cache
    assert chunked.engine.stats().prefix_cache_hits > hits
    assert_idle(chunked.engine)


def test_seeded_sampling_independent_of_batch_mates(tiny_llama, variant):
    """Same seed + prompt → same samples, whatever else is in the batch; other seeds differ."""
    llm = LLM(model=tiny_llama, dtype="float32", **ON_TEST_DEVICE, max_num_seqs=16, **variant)
    prompt = [101, 2020, 3030, 4040]
    seeded = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, seed=7, ignore_eos=True)
    [alone] = llm.generate(prompt_token_ids=[prompt], sampling_params=seeded)
    others = [
        SamplingParams(temperature=0.8, max_tokens=m, seed=s, ignore_eos=True)
        for m, s in [(5, None), (30, 1), (12, None)]
    ]
    batch = llm.generate(
        prompt_token_ids=[[9, 8, 7], [5000] * 20, prompt, [77, 78]],
        sampling_params=[others[0], others[1], seeded, others[2]],
    )
    assert batch[2].outputs[0].token_ids == alone.outputs[0].token_ids
    [other_seed] = llm.generate(
        prompt_token_ids=[prompt],
        sampling_params=SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, seed=8, ignore_eos=True),
    )
    assert other_seed.outputs[0].token_ids != alone.outputs[0].token_ids
    assert_idle(llm.engine)
