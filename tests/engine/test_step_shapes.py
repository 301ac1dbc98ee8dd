"""Step shapes on the tiny random-weight Llama: padding buckets, prefill attention called at bucket
sizes, no compile after the warm-up, and 16-bit eager steps that mix prefill chunks and decodes.

Each test builds its own engine, since each needs its own budget, block size or dtype.
"""

from __future__ import annotations

import pytest

from replica import LLM
from tests.engine.tiny_engine import MAX_MODEL_LEN, greedy
from tests.helpers import ON_TEST_DEVICE, TEST_DEVICE, assert_idle

pytestmark = pytest.mark.timeout(120)


def test_padded_size_buckets():
    """Exact up to 16 rows, then at most 12.5 % padding, and few distinct sizes for a 512 budget."""
    from replica.kernels.shapes import padded_size

    assert [padded_size(n) for n in range(1, 17)] == list(range(1, 17))
    for n in range(17, 4097):
        size = padded_size(n)
        assert n <= size <= n * 1.125, (n, size)
        assert padded_size(size) == size  # a bucket pads to itself
    assert len({padded_size(n) for n in range(1, 513)}) <= 56


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

    from replica.kernels.shapes import padded_size

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
def test_compiled_engine_never_recompiles_after_its_warm_up(tiny_llama, dtype, chunks, monkeypatch):
    """The warm-up compiles every graph a step needs: single decodes, batched decodes, mixed steps,
    chunked prefills and preemption then run without compiling again (a compile mid-serving costs
    seconds: a served request once waited 30 s for one). On CPU, prefill chunks keep a step in the
    decode graph; with that off (``on-sdpa``, as without Carpool's kernel) they take the other
    graph, which the warm-up then compiles too."""
    import torch._dynamo

    import replica.attention.cpu as cpu_attention

    if chunks == "on-sdpa":
        monkeypatch.setattr(cpu_attention, "INLINE_CHUNK_PAIRS", 0)
    llm = LLM(model=tiny_llama, dtype=dtype, **ON_TEST_DEVICE, max_num_seqs=3, max_num_batched_tokens=24,
              block_size=4, num_blocks=24, max_model_len=96)
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


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_warm_up_steps_fit_blocks_smaller_than_their_queries(tiny_llama, backend):
    """The warm-up's dummy steps (compiled engines run them at start) give every sequence a block
    table that holds its keys, also with blocks of 1 token: an engine with the reference backend,
    compile and ``block_size=1`` once failed to start (SDPA's mask 1 key longer than the context)."""
    from replica.worker.warm_up import dummy_step

    llm = LLM(model=tiny_llama, dtype="float32", **ON_TEST_DEVICE, compile=False, attention_backend=backend,
              block_size=1, num_blocks=64, max_num_seqs=4, max_model_len=32)
    for query_lens, width in [([2, 1], 2), ([5], 1), ([3, 1, 1], 3)]:
        dummy_step(llm.engine.runner, query_lens, width)
    [out] = llm.generate(prompt_token_ids=[[5, 6, 7, 8, 9]], sampling_params=greedy(max_tokens=4))
    assert len(out.outputs[0].token_ids) == 4
    assert_idle(llm.engine)
