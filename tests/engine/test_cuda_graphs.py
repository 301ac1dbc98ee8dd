"""Decode steps through ``DecodeGraphs`` (replica/worker/cuda_graphs.py): the buckets, the padding of the
static buffers, and greedy fidelity of the padded static-buffer path.

On CPU the path runs without capturing (``capture=False``): the same buckets, buffers and padding,
and the same compiled decoder with decode attention traced in, so every token is checked here; only
the capture and the replay themselves need a GPU. On CUDA (tests/gpu/device_check.sh) the engine
captures graphs by default, and the last test checks its tokens against an engine without them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replica import LLM, SamplingParams
from replica.kernels import cpu_kernels
from replica.worker import cuda_graphs
from replica.worker.cuda_graphs import (
    MAX_GRAPH_BATCH,
    MAX_GRAPH_CONTEXT,
    DecodeGraphs,
    graph_batch_sizes,
    graph_memory_reserve,
    graph_widths,
)
from tests.engine.test_fidelity import WORKLOAD, reference_tokens, run_engine
from tests.helpers import ON_TEST_DEVICE, TEST_DEVICE, assert_idle


def test_batch_sizes_and_widths():
    assert graph_batch_sizes(1) == [2]
    assert graph_batch_sizes(4) == [2, 4]
    assert graph_batch_sizes(32) == [2, 4, 8, 16, 24, 32]
    assert graph_batch_sizes(100)[-3:] == [88, 96, 100]
    assert graph_batch_sizes(10_000)[-1] == MAX_GRAPH_BATCH
    assert graph_widths(1) == [2]
    assert graph_widths(12) == [2, 4, 8, 12]
    assert graph_widths(128) == [2, 4, 8, 16, 32, 64, 128]


def test_graphs_stop_at_max_graph_context_and_the_reserve_grows_with_seats():
    graphs = DecodeGraphs(lambda *a: None, max_num_seqs=8, max_blocks=1000, block_size=16, spare_block=999,
                          device=torch.device("cpu"), capture=False)
    assert graphs.widths[-1] * 16 == MAX_GRAPH_CONTEXT
    assert graphs.bucket(2, MAX_GRAPH_CONTEXT // 16) == (2, MAX_GRAPH_CONTEXT // 16)
    assert graphs.bucket(2, MAX_GRAPH_CONTEXT // 16 + 1) is None  # longer contexts: the backend's kernels
    small = graph_memory_reserve(8, 1024, 32, 128_000)
    assert small > 8 * 128_000 * 4 and small < graph_memory_reserve(64, 1024, 32, 128_000)
    assert graph_memory_reserve(8, 100_000, 32, 128_000) == graph_memory_reserve(8, MAX_GRAPH_CONTEXT, 32, 128_000)


def _recording_graphs(seen: list, max_num_seqs=32, max_blocks=12) -> DecodeGraphs:
    """Graphs whose forward records its inputs and returns them as 'logits' rows."""

    def forward(ids, positions, decode):
        seen.append((ids.clone(), positions.clone(), decode.slot_mapping.clone(), decode.block_tables.clone(),
                     decode.seq_lens.clone()))
        return torch.stack([ids[0], positions[0], decode.slot_mapping, decode.seq_lens], dim=1)

    return DecodeGraphs(forward, max_num_seqs=max_num_seqs, max_blocks=max_blocks, block_size=16, spare_block=99,
                        device=torch.device("cpu"), capture=False)


def test_buckets_pick_the_smallest_graph_that_holds_the_step():
    graphs = _recording_graphs([])
    assert graphs.bucket(1, 1) == (2, 2)
    assert graphs.bucket(5, 3) == (8, 4)
    assert graphs.bucket(17, 12) == (24, 12)
    assert graphs.bucket(33, 2) is None  # more sequences than seats
    assert graphs.bucket(2, 13) is None  # wider than max_model_len
    seen: list = []
    graphs = _recording_graphs(seen)
    too_many = graphs.run(*(np.zeros(33, np.int64) for _ in range(3)), np.zeros((33, 2), np.int64), np.ones(33, np.int64))
    assert too_many is None and not seen and graphs.steps_run == 0  # the step runs without a graph


def test_a_step_is_padded_with_one_token_sequences_on_the_spare_block():
    seen: list = []
    graphs = _recording_graphs(seen)
    ids, positions, slots, lens = (np.array(v, dtype=np.int64) for v in ([7, 8, 9], [40, 3, 17], [640, 51, 209], [41, 4, 18]))
    tables = np.array([[40, 41, 42], [3, 0, 0], [13, 14, 0]], dtype=np.int64)
    out = graphs.run(ids, positions, slots, tables, lens)
    # The first call of a bucket warms it up and then runs it: both saw the step, padded to (4, 4).
    assert len(seen) == 2 and graphs.steps_run == 1
    got_ids, got_pos, got_slots, got_tables, got_lens = seen[-1]
    assert got_ids.tolist() == [[7, 8, 9, 0]] and got_pos.tolist() == [[40, 3, 17, 0]]
    assert got_slots.tolist() == [640, 51, 209, 99 * 16]  # padding writes the spare block's first slot
    assert got_lens.tolist() == [41, 4, 18, 1]
    assert got_tables.tolist() == [[40, 41, 42, 99], [3, 0, 0, 99], [13, 14, 0, 99], [99, 99, 99, 99]]
    assert out.tolist() == [[7, 40, 640, 41], [8, 3, 51, 4], [9, 17, 209, 18]]  # the real rows only
    # A smaller step of the same bucket: no padding left over from the larger one.
    out = graphs.run(ids[:1], positions[:1], slots[:1], tables[:1, :1], lens[:1])
    assert seen[-1][3].tolist() == [[40, 99], [99, 99]] and out.tolist() == [[7, 40, 640, 41]]


def test_capture_all_visits_every_bucket_on_padding_only():
    seen: list = []
    graphs = _recording_graphs(seen, max_num_seqs=8, max_blocks=4)
    report = graphs.capture_all()
    assert report["cuda_graphs"] == 0  # nothing captured off CUDA
    assert sorted((ids.shape[1], tables.shape[1]) for ids, _, _, tables, _ in seen) == [
        (bs, w) for bs in (2, 4, 8) for w in (2, 4)
    ]
    for ids, positions, slots, tables, lens in seen:
        assert (slots == 99 * 16).all() and (tables == 99).all() and (lens == 1).all() and (ids == 0).all()


def graph_engine(path: str, **kwargs) -> LLM:
    llm = LLM(model=path, dtype="float32", **ON_TEST_DEVICE, **kwargs)
    if llm.engine.runner.graphs is None:  # off CUDA: the same path, not captured
        llm.engine.runner.enable_decode_graphs(capture=False)
    return llm


# (policy, scenario, attention inside the graph): on CPU Carpool's C++ decode kernel when it is
# built, else ("torch") the torch formulation that CUDA graphs replay on a GPU.
CASES = [
    ("continuous", "few-seats", "default"),
    ("static", "few-seats", "default"),
    ("continuous", "preemption", "default"),
    ("static", "preemption", "default"),
    ("continuous", "few-seats", "torch"),
    ("continuous", "preemption", "torch"),
]
SCENARIO_KWARGS = {"few-seats": dict(max_num_seqs=4), "preemption": dict(max_num_seqs=16, num_blocks=12, max_model_len=192)}


@pytest.mark.parametrize("policy,scenario,attention", CASES, ids=["-".join(c) for c in CASES])
def test_graph_decode_steps_match_transformers_generate(tiny_llama, policy, scenario, attention, monkeypatch):
    if attention == "torch":
        monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    llm = graph_engine(tiny_llama, batching_policy=policy, **SCENARIO_KWARGS[scenario])
    got, _ = run_engine(llm, WORKLOAD, None)
    assert got == reference_tokens(tiny_llama, WORKLOAD)
    assert llm.engine.runner.graphs.steps_run > 0
    if scenario == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    assert_idle(llm.engine)


def test_decode_steps_wider_than_every_graph_run_without_one(tiny_llama, monkeypatch):
    """With graphs up to 64-token contexts, decode steps over longer contexts take the backend's
    path, also mid-request; tokens stay those of transformers generate."""
    monkeypatch.setattr(cuda_graphs, "MAX_GRAPH_CONTEXT", 64)
    llm = graph_engine(tiny_llama, max_num_seqs=2)
    graphs = llm.engine.runner.graphs
    assert graphs.widths == [2, 4]
    run, outcomes = graphs.run, []

    def counted(*args, **kwargs):
        logits = run(*args, **kwargs)
        outcomes.append(logits is not None)
        return logits

    graphs.run = counted
    got, _ = run_engine(llm, WORKLOAD, None)
    assert got == reference_tokens(tiny_llama, WORKLOAD)
    assert any(outcomes) and not all(outcomes)  # both paths ran
    assert_idle(llm.engine)


def test_graph_decode_steps_are_batch_invariant(tiny_llama):
    """Alone (padded to 2) and among 11 others (padded to 16), a request's tokens are the same."""
    llm = graph_engine(tiny_llama, max_num_seqs=16)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ids = [[(37 * i + 11 * j) % 49000 + 3 for j in range(4 + 5 * i)] for i in range(12)]
    together = llm.generate(prompt_token_ids=ids, sampling_params=params)
    for i in (0, 11):
        [alone] = llm.generate(prompt_token_ids=[ids[i]], sampling_params=params)
        assert alone.outputs[0].token_ids == together[i].outputs[0].token_ids
    assert_idle(llm.engine)


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="captures CUDA graphs: CUDA only")
def test_captured_graphs_give_the_tokens_of_an_engine_without_them(tiny_llama):
    with_graphs = LLM(model=tiny_llama, dtype="float32", **ON_TEST_DEVICE, max_num_seqs=8)
    assert with_graphs.engine.runner.graphs is not None and with_graphs.engine.runner.graphs.num_captured > 0
    without = LLM(model=tiny_llama, dtype="float32", **ON_TEST_DEVICE, max_num_seqs=8, cuda_graphs=False)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[5, 6, 7], [900] * 30, [12, 13], [40000, 3, 4, 5, 6]]
    a = with_graphs.generate(prompt_token_ids=prompts, sampling_params=params)
    b = without.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert with_graphs.engine.runner.graphs.steps_run > 0
    assert_idle(with_graphs.engine)
