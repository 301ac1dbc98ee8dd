"""Scheduler driven by hand: admission, seats, blocks, the token budget, chunked prefill and
preemption; exactly which requests run at each step, with how many tokens and blocks (finishing,
abort and the static policy: test_scheduler_finish.py).

Pure Python, no torch. Each test calls ``schedule()`` and then ``update_from_output(out, tokens)``
with made-up token ids (never EOS unless a test says so), as the engine does around its forward.

Step accounting: ``Scheduler.step_count`` counts non-empty ``schedule()`` calls, so step 1 is the
first step, the prefill step that yields each admitted request's first output token (when its
whole prompt fits the token budget). ``request.finish_step`` is the step whose sample finished it;
a request with ``max_tokens=N`` admitted (and fully prefilled) at step ``s`` finishes at step
``s + N - 1``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from replica.core.request import RequestStatus
from replica.protocol.outputs import FinishReason
from tests.unit.scheduler_driver import FILLER, assert_blocks_consistent, detail, ids, make_scheduler, req, rows, step


def test_scheduler_modules_do_not_import_torch():
    code = (
        "import sys\n"
        "import replica.core.scheduler, replica.core.block_manager, replica.core.request\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print('ok')\n"
    )
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=repo)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


# ---- basics ----------------------------------------------------------------------------------


def test_bad_policy_raises():
    with pytest.raises(ValueError, match="batching_policy"):
        make_scheduler(policy="fifo")
    with pytest.raises(ValueError, match="scheduling_policy must be 'fcfs' or 'priority'"):
        make_scheduler(scheduling="fifo")


def test_empty_scheduler_does_not_count_a_step():
    sched = make_scheduler()
    out = sched.schedule()
    assert out.is_empty and out.step == 1
    sched.update_from_output(out, [])
    assert sched.step_count == 0
    assert not sched.has_unfinished_requests()


def test_add_request_rejects_duplicate_id_and_too_long_prompt():
    sched = make_scheduler(max_model_len=8)
    sched.add_request(req("a", 3))
    with pytest.raises(ValueError, match="request_id 'a' is already in use"):
        sched.add_request(req("a", 3))
    with pytest.raises(ValueError, match="maximum context length is 8 tokens"):
        sched.add_request(req("b", 8))  # no room for one output token
    sched.add_request(req("c", 7))  # exactly one output token fits
    assert ids(sched.waiting) == ["a", "c"]


def test_fcfs_admission_and_seats():
    sched = make_scheduler(max_num_seqs=2)
    for rid in "abc":
        sched.add_request(req(rid, 3))
    out = step(sched)
    assert detail(out) == [("a", 0, 3, True, False), ("b", 0, 3, True, False)]
    assert ids(sched.running) == ["a", "b"] and ids(sched.waiting) == ["c"]
    assert sched.requests["c"].status == RequestStatus.WAITING
    assert sched.requests["a"].output_token_ids == [FILLER]
    assert sched.requests["a"].num_computed_tokens == 3
    # Decodes: 1 token each, starting at the position of the last known token; c keeps waiting.
    out = step(sched)
    assert detail(out) == [("a", 3, 1, True, False), ("b", 3, 1, True, False)]
    assert ids(sched.waiting) == ["c"]
    assert sched.num_running == 2 and sched.num_waiting == 1


def test_blocks_follow_the_tokens():
    sched = make_scheduler(block_size=4)
    a = req("a", 3)
    b = req("b", 5)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)  # a: 3 tokens → 1 block; b: 5 tokens → 2 blocks
    assert a.block_ids == [0] and b.block_ids == [1, 2]
    step(sched)  # a computes token 3 (4 tokens: still 1 block); b computes token 5 (6 tokens)
    assert a.block_ids == [0] and b.block_ids == [1, 2]
    step(sched)  # a computes token 4 → needs a 2nd block; b 7 tokens
    assert a.block_ids == [0, 3] and b.block_ids == [1, 2]
    step(sched)  # b computes token 7 (8 tokens); step 5: b's 9th token needs block 4
    assert b.block_ids == [1, 2]
    step(sched)
    assert a.block_ids == [0, 3] and b.block_ids == [1, 2, 4]
    assert sched.block_manager.num_used_blocks == 5
    assert_blocks_consistent(sched)


def test_head_of_line_waits_for_blocks_fcfs():
    """A waiting request that does not fit blocks the queue: a later small one does not jump it."""
    sched = make_scheduler(num_blocks=3, block_size=4, max_num_seqs=4)
    sched.add_request(req("a", 8, max_tokens=1))  # 2 blocks
    sched.add_request(req("b", 8))  # needs 2, 1 left
    sched.add_request(req("c", 2))  # would fit in 1, but comes after b
    out = step(sched)
    assert rows(out) == [("a", 8)]
    assert ids(sched.waiting) == ["b", "c"]
    # a finished at step 1 (max_tokens=1): its blocks are free, b and c are admitted at step 2.
    assert sched.requests.get("a") is None
    assert sched.block_manager.num_free_blocks == 3
    out = step(sched)
    assert rows(out) == [("b", 8), ("c", 2)]
    assert sched.requests["b"].block_ids == [2, 1]  # freed blocks come back tail first
    assert sched.requests["c"].block_ids == [0]


# ---- token budget and chunked prefill ----------------------------------------------------------


def test_chunked_prefill_samples_only_on_last_chunk():
    sched = make_scheduler(block_size=4, max_num_batched_tokens=10)
    a = req("a", 25)
    sched.add_request(a)
    out = step(sched)
    assert detail(out) == [("a", 0, 10, False, False)]
    assert a.num_computed_tokens == 10 and a.output_token_ids == [] and len(a.block_ids) == 3
    out = step(sched)
    assert detail(out) == [("a", 10, 10, False, False)]
    assert a.num_computed_tokens == 20 and a.output_token_ids == [] and len(a.block_ids) == 5
    out = step(sched, {"a": 77})
    assert detail(out) == [("a", 20, 5, True, False)]
    assert a.num_computed_tokens == 25 and a.output_token_ids == [77] and len(a.block_ids) == 7
    out = step(sched)
    assert detail(out) == [("a", 25, 1, True, False)]
    assert a.output_token_ids == [77, FILLER]
    assert_blocks_consistent(sched)


def test_running_first_then_waiting_with_the_rest_of_the_budget():
    """A running prefill spends the budget before a waiting request is admitted."""
    sched = make_scheduler(max_num_batched_tokens=4)
    sched.add_request(req("a", 10))
    sched.add_request(req("b", 3))
    assert rows(step(sched)) == [("a", 4)]  # budget gone: b not admitted
    assert ids(sched.waiting) == ["b"]
    assert rows(step(sched)) == [("a", 4)]
    out = step(sched)  # a's last 2 prompt tokens, then b gets the remaining 2 (a chunk)
    assert detail(out) == [("a", 8, 2, True, False), ("b", 0, 2, False, False)]
    out = step(sched)  # prefill and decode mixed in one step
    assert detail(out) == [("a", 10, 1, True, False), ("b", 2, 1, True, False)]
    out = step(sched)
    assert detail(out) == [("a", 11, 1, True, False), ("b", 3, 1, True, False)]


def test_decodes_first_then_chunk_of_waiting_prompt():
    sched = make_scheduler(max_num_batched_tokens=4)
    sched.add_request(req("a", 2))
    sched.add_request(req("b", 2))
    assert rows(step(sched)) == [("a", 2), ("b", 2)]
    sched.add_request(req("c", 6))
    out = step(sched)
    assert detail(out) == [("a", 2, 1, True, False), ("b", 2, 1, True, False), ("c", 0, 2, False, False)]
    out = step(sched)
    assert detail(out) == [("a", 3, 1, True, False), ("b", 3, 1, True, False), ("c", 2, 2, False, False)]
    out = step(sched)
    assert detail(out) == [("a", 4, 1, True, False), ("b", 4, 1, True, False), ("c", 4, 2, True, False)]
    assert sched.requests["c"].output_token_ids == [FILLER]
    assert out.num_batched_tokens == 4


def test_prefill_and_decode_mixed_in_one_step():
    sched = make_scheduler()
    sched.add_request(req("a", 5))
    step(sched)
    step(sched)
    sched.add_request(req("b", 7))
    out = step(sched)
    assert detail(out) == [("a", 6, 1, True, False), ("b", 0, 7, True, False)]
    assert out.num_batched_tokens == 8


# ---- preemption by recompute -------------------------------------------------------------------


def test_preemption_of_newest_running_request_and_recompute():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2)
    a = req("a", 4, max_tokens=7)
    b = req("b", 4)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)  # step 1: a [0], b [1]
    step(sched)  # step 2: 5th token each: a [0, 2], b [1, 3]; pool empty
    assert a.block_ids == [0, 2] and b.block_ids == [1, 3]
    for _ in range(3):  # steps 3-5: tokens 6..8 fit in two blocks
        out = step(sched)
        assert rows(out) == [("a", 1), ("b", 1)] and out.preempted == []
    assert a.num_tokens == b.num_tokens == 9 and b.output_token_ids == [FILLER] * 5
    # Step 6: a's 9th token needs a 3rd block; none is free → b (the newest) is preempted.
    out = step(sched)
    assert rows(out) == [("a", 1)]
    assert out.preempted == [b]
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0 and b.block_ids == []
    assert b.num_preemptions == 1 and sched.num_preemptions == 1
    assert ids(sched.waiting) == ["b"] and ids(sched.running) == ["a"]
    assert b.output_token_ids == [FILLER] * 5  # kept: recomputed, not regenerated
    assert a.block_ids == [0, 2, 3]  # b's blocks went back tail first: [3, 1]
    assert sched.block_manager.block_table("b") == []
    assert_blocks_consistent(sched)
    # Step 7: a samples its 7th token and finishes; b (9 tokens = 3 blocks) does not fit yet.
    out = step(sched)
    assert rows(out) == [("a", 1)]
    assert a.finish_reason == FinishReason.LENGTH and a.finish_step == 7
    assert ids(sched.running) == [] and ids(sched.waiting) == ["b"]
    assert sched.block_manager.num_free_blocks == 4
    # Step 8: b re-prefills prompt + its 5 output tokens in one chunk and samples its 6th token.
    out = step(sched, {"b": 55})
    assert detail(out) == [("b", 0, 9, True, False)]
    assert b.output_token_ids == [FILLER] * 5 + [55]
    assert b.block_ids == [1, 3, 2] and b.status == RequestStatus.RUNNING
    out = step(sched)
    assert detail(out) == [("b", 9, 1, True, False)]
    assert_blocks_consistent(sched)


def test_preemption_when_the_request_needing_a_block_is_the_newest():
    """The newest request preempts itself; the older one keeps running; nobody is admitted."""
    sched = make_scheduler(num_blocks=3, block_size=4, max_num_seqs=3)
    a = req("a", 5)  # 2 blocks
    b = req("b", 4)  # 1 block
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    assert a.block_ids == [0, 1] and b.block_ids == [2]
    sched.add_request(req("c", 1))
    out = step(sched)  # a: token 6 fits; b: token 5 needs a 2nd block → b preempted
    assert rows(out) == [("a", 1)]
    assert out.preempted == [b]
    assert ids(sched.waiting) == ["b", "c"]  # first in waiting, ahead of the older arrival c
    assert ids(sched.running) == ["a"]
    assert b.num_computed_tokens == 0 and b.block_ids == [] and b.output_token_ids == [FILLER]
    out = step(sched)  # a still fits its 2 blocks; b (5 tokens) needs 2 blocks, 1 free → waits
    assert rows(out) == [("a", 1)]
    assert ids(sched.waiting) == ["b", "c"]
    assert_blocks_consistent(sched)
