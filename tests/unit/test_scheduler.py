"""Scheduler driven by hand: exactly which requests run at each step, with how many tokens and blocks.

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

from replica.block_manager import BlockManager
from replica.request import FinishReason, Request, RequestStatus, SamplingParams
from replica.scheduler import Scheduler
from replica.scheduler_output import SchedulerOutput

EOS = 2
FILLER = 1000  # made-up sampled token: never EOS, never a stop id used below


def test_scheduler_modules_do_not_import_torch():
    code = (
        "import sys\n"
        "import replica.scheduler, replica.block_manager, replica.request\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print('ok')\n"
    )
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=repo)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


# ---- helpers ---------------------------------------------------------------------------------


def req(rid: str, prompt_len: int, max_tokens: int = 1000, *, ignore_eos: bool = False, **params) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=[10 + i for i in range(prompt_len)],
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, **params),
        eos_token_ids=(EOS,),
    )


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    policy: str = "continuous",
) -> Scheduler:
    return Scheduler(
        BlockManager(num_blocks, block_size),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        policy=policy,
    )


def step(sched: Scheduler, tokens: dict[str, int] | None = None) -> SchedulerOutput:
    """One schedule + update; a sampling row gets ``tokens[rid]`` or FILLER."""
    out = sched.schedule()
    sampled = [
        (tokens or {}).get(s.request.request_id, FILLER) if s.samples else None for s in out.scheduled
    ]
    sched.update_from_output(out, sampled)
    return out


def rows(out: SchedulerOutput) -> list[tuple[str, int]]:
    """(request id, tokens computed this step) per scheduled row, in the step's order."""
    return [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]


def detail(out: SchedulerOutput) -> list[tuple[str, int, int, bool, bool]]:
    return [(s.request.request_id, s.start, s.num_new_tokens, s.samples, s.is_padding) for s in out.scheduled]


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


def assert_blocks_consistent(sched: Scheduler) -> None:
    bm = sched.block_manager
    bm.check_integrity()
    for r in list(sched.running) + list(sched.waiting):
        assert r.block_ids == bm.block_table(r.request_id), r.request_id
    live = {r.request_id for r in sched.running} | {r.request_id for r in sched.waiting}
    assert set(bm.owners()) <= live


# ---- basics ----------------------------------------------------------------------------------


def test_bad_policy_raises():
    with pytest.raises(ValueError, match="scheduling_policy"):
        make_scheduler(policy="fifo")


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
    with pytest.raises(ValueError, match="max_model_len"):
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


# ---- finishing ----------------------------------------------------------------------------------


def test_finish_on_eos_frees_seat_and_blocks_in_the_same_step():
    sched = make_scheduler(max_num_seqs=1)
    a = req("a", 3)
    sched.add_request(a)
    sched.add_request(req("b", 3))
    step(sched)
    out = step(sched, {"a": EOS})
    assert rows(out) == [("a", 1)]
    assert a.status == RequestStatus.FINISHED and a.finish_reason == FinishReason.STOP
    assert a.stop_reason is None and a.output_token_ids == [FILLER, EOS] and a.finish_step == 2
    assert sched.running == [] and a.block_ids == []
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    assert "a" not in sched.requests
    assert ids(sched.waiting) == ["b"]  # admitted next step, not in this one
    out = step(sched)
    assert rows(out) == [("b", 3)]
    assert sched.step_count == 3


def test_ignore_eos_keeps_going_until_max_tokens():
    sched = make_scheduler()
    a = req("a", 3, max_tokens=4, ignore_eos=True)
    sched.add_request(a)
    for _ in range(3):
        step(sched, {"a": EOS})
        assert a.status == RequestStatus.RUNNING
    step(sched, {"a": EOS})
    assert a.finish_reason == FinishReason.LENGTH and a.output_token_ids == [EOS] * 4
    assert a.finish_step == 4


def test_min_tokens_ignores_eos_before_min():
    sched = make_scheduler()
    a = req("a", 3, min_tokens=2)
    sched.add_request(a)
    step(sched, {"a": EOS})
    assert a.status == RequestStatus.RUNNING
    step(sched, {"a": EOS})
    assert a.finish_reason == FinishReason.STOP and a.num_output_tokens == 2


def test_finish_on_stop_token_id():
    sched = make_scheduler()
    a = req("a", 3, stop_token_ids=[7, 9])
    sched.add_request(a)
    step(sched)
    step(sched, {"a": 9})
    assert a.finish_reason == FinishReason.STOP and a.stop_reason == 9
    assert a.output_token_ids == [FILLER, 9] and a.finish_step == 2
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_stop_token_id_counts_even_with_ignore_eos():
    sched = make_scheduler()
    a = req("a", 3, stop_token_ids=[EOS], ignore_eos=True)
    sched.add_request(a)
    step(sched, {"a": EOS})
    assert a.finish_reason == FinishReason.STOP and a.stop_reason == EOS


def test_finish_on_max_tokens():
    sched = make_scheduler()
    a = req("a", 3, max_tokens=3)
    sched.add_request(a)
    step(sched)
    step(sched)
    assert a.status == RequestStatus.RUNNING
    step(sched)
    assert a.finish_reason == FinishReason.LENGTH and a.stop_reason is None
    assert a.num_output_tokens == 3 and a.finish_step == 3
    assert not sched.has_unfinished_requests()


def test_finish_on_max_model_len():
    sched = make_scheduler(max_model_len=8)
    a = req("a", 5)
    sched.add_request(a)
    step(sched)  # 6 tokens
    step(sched)  # 7 tokens
    assert a.status == RequestStatus.RUNNING
    step(sched)  # 8 tokens = max_model_len
    assert a.finish_reason == FinishReason.LENGTH and a.num_tokens == 8 and a.finish_step == 3


def test_freed_seat_goes_to_the_next_waiting_request_in_the_next_step():
    sched = make_scheduler(max_num_seqs=2)
    sched.add_request(req("a", 2, max_tokens=2))
    sched.add_request(req("b", 2, max_tokens=5))
    sched.add_request(req("c", 2))
    sched.add_request(req("d", 2))
    assert rows(step(sched)) == [("a", 2), ("b", 2)]
    assert rows(step(sched)) == [("a", 1), ("b", 1)]  # a finishes here
    assert ids(sched.running) == ["b"]
    assert rows(step(sched)) == [("b", 1), ("c", 2)]
    assert ids(sched.waiting) == ["d"]


# ---- abort --------------------------------------------------------------------------------------


def test_abort_waiting_request():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(req("a", 3))
    sched.add_request(req("b", 3))
    step(sched)
    b = sched.finish_request("b", FinishReason.ABORT)
    assert b is not None and b.finish_reason == FinishReason.ABORT and b.is_finished
    assert ids(sched.waiting) == [] and "b" not in sched.requests
    assert sched.finish_request("b", FinishReason.ABORT) is None
    assert sched.finish_request("nobody", FinishReason.ABORT) is None
    assert rows(step(sched)) == [("a", 1)]


def test_abort_running_request_frees_seat_and_blocks_at_once():
    sched = make_scheduler(max_num_seqs=1, block_size=4)
    sched.add_request(req("a", 6))
    sched.add_request(req("b", 3))
    step(sched)
    assert sched.block_manager.num_used_blocks == 2
    a = sched.finish_request("a", FinishReason.ABORT)
    assert a.status == RequestStatus.FINISHED and a.block_ids == []
    assert sched.running == [] and sched.block_manager.num_used_blocks == 0
    assert a.finish_step == 1
    assert rows(step(sched)) == [("b", 3)]
    assert_blocks_consistent(sched)


def test_abort_during_a_step_drops_its_sample():
    sched = make_scheduler()
    a = req("a", 3)
    sched.add_request(a)
    sched.add_request(req("b", 3))
    out = sched.schedule()
    sched.finish_request("a", FinishReason.ABORT)  # e.g. a client disconnect while the forward runs
    produced = sched.update_from_output(out, [5, 6])
    assert ids(produced) == ["b"]
    assert a.output_token_ids == [] and a.num_computed_tokens == 0
    assert a.finish_reason == FinishReason.ABORT
    assert_blocks_consistent(sched)


# ---- static policy -------------------------------------------------------------------------------


def test_static_finished_member_is_padding_until_the_batch_ends():
    sched = make_scheduler(policy="static", max_num_seqs=2, block_size=4)
    a = req("a", 3, max_tokens=2)
    b = req("b", 3, max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    sched.add_request(req("c", 3))
    assert detail(step(sched)) == [("a", 0, 3, True, False), ("b", 0, 3, True, False)]
    out = step(sched)  # a samples its 2nd token: finished, but keeps seat, blocks and row
    assert rows(out) == [("a", 1), ("b", 1)]
    assert a.status == RequestStatus.FINISHED and a.is_padding and a.finish_step == 2
    assert ids(sched.running) == ["a", "b"] and a.block_ids == [0] and b.block_ids == [1]
    assert sched.num_running == 1 and sched.num_seats_taken == 2
    assert ids(sched.waiting) == ["c"]
    out = step(sched)  # step 3: b decodes, a's padding row is computed after it, c waits
    assert detail(out) == [("b", 4, 1, True, False), ("a", 4, 1, True, True)]
    assert a.output_token_ids == [FILLER, FILLER]  # padding samples are thrown away
    assert a.num_computed_tokens == 5
    assert b.block_ids == [1, 2] and a.block_ids == [0, 3]  # the padding row grows its blocks too
    out = step(sched)  # step 4: b finishes → the whole batch leaves
    assert detail(out) == [("b", 5, 1, True, False), ("a", 5, 1, True, True)]
    assert b.finish_reason == FinishReason.LENGTH and b.finish_step == 4
    assert sched.running == [] and sched.block_manager.num_used_blocks == 0
    assert "a" not in sched.requests and "b" not in sched.requests
    assert detail(step(sched)) == [("c", 0, 3, True, False)]


def test_static_no_admission_while_a_batch_runs():
    sched = make_scheduler(policy="static", max_num_seqs=4)
    sched.add_request(req("a", 3, max_tokens=3))
    sched.add_request(req("b", 3, max_tokens=3))
    step(sched)
    sched.add_request(req("c", 3))  # 2 free seats, but the batch is formed
    assert rows(step(sched)) == [("a", 1), ("b", 1)]
    assert rows(step(sched)) == [("a", 1), ("b", 1)]  # both finish at step 3
    assert sched.running == []
    assert rows(step(sched)) == [("c", 3)]


def test_static_batch_members_beyond_the_budget_hold_their_seats():
    sched = make_scheduler(policy="static", max_num_seqs=3, max_num_batched_tokens=10)
    for rid in "abc":
        sched.add_request(req(rid, 8))
    sched.add_request(req("d", 1))
    out = step(sched)
    assert detail(out) == [("a", 0, 8, True, False), ("b", 0, 2, False, False)]
    assert ids(sched.running) == ["a", "b", "c"] and ids(sched.waiting) == ["d"]
    assert sched.requests["c"].block_ids == []
    out = step(sched)
    assert rows(out) == [("a", 1), ("b", 6), ("c", 3)]
    out = step(sched)
    assert rows(out) == [("a", 1), ("b", 1), ("c", 5)]
    assert ids(sched.waiting) == ["d"]


def test_static_abort_of_the_last_unfinished_member_releases_the_batch():
    sched = make_scheduler(policy="static", max_num_seqs=2)
    a = req("a", 3, max_tokens=1)
    sched.add_request(a)
    sched.add_request(req("b", 3))
    sched.add_request(req("c", 3))
    step(sched)
    assert a.is_padding and ids(sched.running) == ["a", "b"]
    sched.finish_request("b", FinishReason.ABORT)
    assert sched.running == [] and sched.block_manager.num_used_blocks == 0
    assert rows(step(sched)) == [("c", 3)]


# ---- the seed article's example -------------------------------------------------------------------


def _seed_example(policy: str) -> dict[str, Request]:
    """A 100, B 20, C 50, D 200 output tokens on 4 seats, all from step 1; E (30) after step 1.

    Step 1 prefills A-D (4-token prompts) and yields each one's first token, so a request with N
    output tokens admitted at step s finishes at step s + N - 1: B at 20, C at 50, A at 100, D at
    200. Continuous: B's seat is free at the end of step 20, E is prefilled at step 21 and its
    30th token comes at step 50. Static: E is admitted only after the whole batch ends at step 200,
    so it is prefilled at step 201 and finishes at step 230. EOS is sampled at every step and
    ignored (``ignore_eos``), so every request ends on ``max_tokens``.
    """
    sched = make_scheduler(
        policy=policy, num_blocks=128, block_size=16, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512
    )
    reqs = {rid: req(rid, 4, max_tokens=n, ignore_eos=True) for rid, n in zip("ABCDE", (100, 20, 50, 200, 30))}
    for rid in "ABCD":
        sched.add_request(reqs[rid])
    assert rows(step(sched)) == [(rid, 4) for rid in "ABCD"]
    sched.add_request(reqs["E"])
    while sched.has_unfinished_requests():
        step(sched, {rid: EOS for rid in reqs})  # EOS every step: ignored
        sched.block_manager.check_integrity()
    assert sched.block_manager.num_used_blocks == 0 and sched.running == []
    for r in reqs.values():
        assert r.finish_reason == FinishReason.LENGTH
        assert r.num_output_tokens == r.sampling_params.max_tokens
    return reqs


def test_seed_example_continuous():
    """E takes B's seat right after B finishes at step 20: E's 30 tokens come at steps 21-50."""
    reqs = _seed_example("continuous")
    assert {rid: r.finish_step for rid, r in reqs.items()} == {"A": 100, "B": 20, "C": 50, "D": 200, "E": 50}


def test_seed_example_static():
    """E waits for the whole batch (D ends at step 200): E's tokens come at steps 201-230."""
    reqs = _seed_example("static")
    assert {rid: r.finish_step for rid, r in reqs.items()} == {"A": 100, "B": 20, "C": 50, "D": 200, "E": 230}
