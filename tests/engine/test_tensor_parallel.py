"""Tensor parallelism (``tensor_parallel_size=2``): the model sharded by transformers' own plan over
two ranks (two processes in one gloo group on CPU; rank 0 schedules and samples) gives
transformers' greedy tokens (fp32) batched, staggered, in prefill chunks, preempted and alone,
eager and compiled; a size the heads do not split over is refused; the other rank ends with the
engine, and a dead rank fails the step instead of hanging it.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time

import pytest

from replica import LLM, SamplingParams
from replica.engine.llm_engine import EngineStateError
from replica.worker import shm_all_reduce
from tests.engine.test_fidelity import (
    WORKLOAD,
    assert_reference_outputs,
    reference_tokens,
    run_engine,
)
from tests.helpers import assert_idle

pytestmark = pytest.mark.skipif(os.environ.get("CARPOOL_TEST_DEVICE", "cpu") != "cpu", reason="CPU ranks (gloo)")

# Chunked prefill (24-token budget) and preemption (12 blocks of 16 for 16 requests of up to 130
# tokens) in the same run.
TIGHT = dict(max_num_seqs=16, max_num_batched_tokens=24, num_blocks=12, max_model_len=192)


def _gone(pid: int, within_s: float) -> bool:
    """Whether process ``pid`` ends (or is a zombie: ended, not yet reaped) within ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rpartition(")")[2].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


@pytest.mark.parametrize(
    "family, compile_, async_scheduling, speculate",
    [("llama", False, False, False), ("llama", True, False, False), ("qwen2", True, True, False), ("llama", True, False, True)],
    ids=["llama-eager", "llama-compiled", "qwen2-compiled-async", "llama-compiled-speculative"],
)
def test_tp2_greedy_matches_transformers_generate(tiny_model_factory, family, compile_, async_scheduling, speculate):
    """Batched with chunks and preemption, staggered, then each request alone: transformers' tokens
    (with async scheduling, decode rows take their input token from the step in flight, which
    rank 0 sends the other rank in the step message; with speculative decoding, rows verify the
    drafts of an unsharded draft model on rank 0 — the target itself, so every draft is kept)."""
    path = tiny_model_factory(family)
    expected = reference_tokens(path, WORKLOAD)
    settings = dict(compile=compile_, async_scheduling=async_scheduling, **TIGHT)
    if speculate:
        settings["speculative_config"] = dict(method="draft_model", model=path, num_speculative_tokens=3, adaptive=False)
    with LLM(model=path, dtype="float32", tensor_parallel_size=2, **settings) as llm:
        if speculate:  # the planner's step timing runs on every rank, as a forward does
            assert all(t > 0 for t in llm.engine.runner.time_forwards([2, 5], 4))
        runner = llm.engine.runner
        assert runner.tp.world_size == 2 and runner.shape.num_kv_heads == 1  # 2 KV heads over 2 ranks
        assert runner.kv_cache.key_cache[0].shape[-2] == 1  # this rank's cache holds its head only
        assert runner.reducer is not None or not shm_all_reduce.available()  # row-wise sums through shared memory
        got, reasons = run_engine(llm, WORKLOAD, None)
        assert_reference_outputs(got, reasons, expected)
        assert llm.engine.scheduler.num_preemptions > 0
        got, reasons = run_engine(llm, WORKLOAD, "staggered")
        assert_reference_outputs(got, reasons, expected)
        for i in (0, 7, 15):
            [alone], _ = run_engine(llm, [WORKLOAD[i]], None)
            assert alone == expected[i], f"request {i} alone"
        assert_idle(llm.engine)
        stats = llm.engine.spec_decode_stats
        assert (stats.num_accepted_tokens == stats.num_draft_tokens > 0) == speculate
        ranks = list(runner.tp.ranks)
    assert all(_gone(r.process.pid, 30) for r in ranks), "a rank outlived LLM.close()"


def test_a_size_the_heads_do_not_split_over_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="4 query heads and 2 KV heads"):
        LLM(model=tiny_llama, dtype="float32", tensor_parallel_size=3, num_blocks=8)
    with pytest.raises(ValueError, match="4 query heads and 2 KV heads"):
        LLM(model=tiny_llama, dtype="float32", tensor_parallel_size=4, num_blocks=8)


def test_a_dead_rank_ends_the_engine_not_hangs_it(tiny_llama):
    """Rank 1 killed mid-life: the next step fails within the collective timeout with
    ``EngineStateError`` (what makes a served replica unhealthy and its callers retry elsewhere),
    and its request has ended with its blocks free."""
    llm = LLM(model=tiny_llama, dtype="float32", tensor_parallel_size=2, compile=False, max_num_seqs=4, num_blocks=32, max_model_len=128)
    engine = llm.engine
    assert not engine.runner.group_broken
    [rank1] = engine.runner.tp.ranks
    rank1.kill()
    rank1.process.wait(10)
    assert engine.runner.group_broken
    request = engine.make_request(None, prompt_token_ids=WORKLOAD[3][0], sampling_params=SamplingParams(temperature=0, max_tokens=4))
    engine.add_prepared_request(request)
    started = time.monotonic()
    with pytest.raises(EngineStateError, match="tensor-parallel group is broken"):
        engine.step()
    assert time.monotonic() - started < 70
    assert request.is_finished
    assert_idle(engine)
    llm.close()


def test_the_ranks_end_when_rank_0_is_killed(tiny_llama, tmp_path):
    """A rank never outlives its group: rank 0's process killed (SIGKILL), rank 1 ends too."""
    script = tmp_path / "rank0.py"
    script.write_text(
        "import sys, time\n"
        "from replica import LLM\n"
        f"llm = LLM(model={tiny_llama!r}, dtype='float32', tensor_parallel_size=2, compile=False, num_blocks=8)\n"
        "print(llm.engine.runner.tp.ranks[0].process.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    rank0 = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=root,
                             env=dict(os.environ, PYTHONPATH=root))
    try:
        rank1_pid = int(rank0.stdout.readline())
        assert not _gone(rank1_pid, 0.5)
        rank0.kill()
        rank0.wait(10)
        assert _gone(rank1_pid, 30), "rank 1 outlived rank 0"
    finally:
        rank0.kill()


def test_a_failed_start_leaves_no_rank_behind(tiny_llama):
    """The engine refuses a setting after the other rank has started (a context longer than the
    KV pool): that rank is ended, not left waiting for rank 0."""
    before = _rank_children()
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(model=tiny_llama, dtype="float32", tensor_parallel_size=2, compile=False, num_blocks=2, max_model_len=1000)
    assert all(_gone(pid, 30) for pid in _rank_children() - before)


def test_an_engine_outlives_the_thread_that_made_it_and_ends_when_dropped(tiny_llama):
    """Made in a thread that then ends, the engine still runs (its rank watches the process, not
    the thread); a second one in the same process is refused before any rank starts; dropped
    without close(), it takes its rank with it."""
    settings = dict(model=tiny_llama, dtype="float32", tensor_parallel_size=2, compile=False, num_blocks=32, max_model_len=128)
    box = {}
    thread = threading.Thread(target=lambda: box.update(llm=LLM(**settings)))
    thread.start()
    thread.join()
    time.sleep(1.5)  # past the rank's look at its parent
    [out] = box["llm"].generate(prompt_token_ids=[WORKLOAD[3][0]], sampling_params=SamplingParams(temperature=0, max_tokens=4))
    assert len(out.outputs[0].token_ids) == 4
    before = _rank_children()
    with pytest.raises(RuntimeError, match="one per process"):
        LLM(**settings)
    assert _rank_children() == before
    [rank] = box["llm"].engine.runner.tp.ranks
    box.clear()
    gc.collect()
    assert _gone(rank.process.pid, 30), "rank 1 outlived its dropped engine"


def _rank_children() -> set[int]:
    """This process's running rank processes (``python -m replica.worker.tp_worker``)."""
    import psutil

    found = set()
    for child in psutil.Process().children():
        try:
            if "replica.worker.tp_worker" in " ".join(child.cmdline()) and child.status() != psutil.STATUS_ZOMBIE:
                found.add(child.pid)
        except psutil.Error:
            pass
    return found
