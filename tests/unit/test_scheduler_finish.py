"""Scheduler driven by hand: how requests finish (EOS, stop ids, limits), abort, the static policy
and the seed article's example. Step accounting as in test_scheduler.py: a request with
``max_tokens=N`` admitted (and fully prefilled) at step ``s`` finishes at step ``s + N - 1``.
"""

from __future__ import annotations

from replica.core.request import Request, RequestStatus
from replica.protocol.outputs import FinishReason
from tests.unit.scheduler_driver import (
    EOS,
    FILLER,
    assert_blocks_consistent,
    detail,
    ids,
    make_scheduler,
    req,
    rows,
    step,
)

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
