"""The ``priority`` scheduling policy driven by hand (vLLM's semantics: lower runs first): the
waiting queue's ``(priority, arrival)`` order, a waiting request preempting running ones of lower
priority for a seat or for blocks, never one of equal or higher priority, the victim when blocks
run out, a preempted request's place back in the queue, and every request finishing (no
livelock). ``fcfs`` is the scheduler of test_scheduler.py, unchanged.

Pure Python, no torch; see ``scheduler_driver`` for the step helpers.
"""

from __future__ import annotations

import random

import pytest

from replica.core.request import RequestStatus
from replica.core.waiting_queue import PriorityQueue, priority_counts
from tests.unit.scheduler_driver import assert_blocks_consistent, ids, make_scheduler, req, rows, step


def run_to_end(sched, max_steps: int = 2000) -> list:
    """Steps until nothing is left; returns each step's output."""
    outs = []
    while sched.has_unfinished_requests():
        outs.append(step(sched))
        assert_blocks_consistent(sched)
        assert len(outs) < max_steps, "no progress: livelock"
    assert sched.block_manager.num_used_blocks == 0 and not sched.running
    sched.block_manager.check_integrity()
    return outs


def test_priority_queue_orders_by_priority_then_arrival():
    queue = PriorityQueue()
    a, b, c, d = (req(r, 2, priority=p) for r, p in (("a", 1), ("b", 0), ("c", 1), ("d", -3)))
    for r in (a, b, c, d):
        queue.append(r)
    assert ids(queue) == ["d", "b", "a", "c"] and len(queue) == 4 and queue[0] is d
    queue.remove(b)
    del queue[0]
    assert ids(queue) == ["a", "c"]
    queue.appendleft(b)  # a preempted request goes back to its own place, not to the front
    assert ids(queue) == ["b", "a", "c"]
    assert queue.popleft() is b and ids(queue) == ["a", "c"]
    with pytest.raises(ValueError):
        queue.remove(d)


def test_admission_follows_priority_then_arrival():
    sched = make_scheduler(max_num_seqs=2, scheduling="priority")
    for rid, priority in (("a", 0), ("b", -1), ("c", 1), ("d", -1)):
        sched.add_request(req(rid, 3, priority=priority))
    out = step(sched)
    assert rows(out) == [("b", 3), ("d", 3)]
    assert ids(sched.waiting) == ["a", "c"]


def test_fcfs_ignores_priority():
    sched = make_scheduler(max_num_seqs=2)
    for rid, priority in (("a", 0), ("b", -1), ("c", 1)):
        sched.add_request(req(rid, 3, priority=priority))
    assert rows(step(sched)) == [("a", 3), ("b", 3)]


def test_a_waiting_request_preempts_a_lower_priority_one_for_a_seat():
    sched = make_scheduler(max_num_seqs=2, scheduling="priority")
    sched.add_request(req("low1", 3, priority=5))
    sched.add_request(req("low2", 3, priority=5))
    step(sched)
    step(sched)
    low2 = sched.requests["low2"]
    generated = list(low2.output_token_ids)
    sched.add_request(req("high", 3, priority=0))
    out = step(sched)  # the newest of the lowest priority gives its seat, which the high one takes in this step
    assert [r.request_id for r in out.preempted] == ["low2"] and rows(out) == [("low1", 1), ("high", 3)]
    assert low2.status == RequestStatus.WAITING and low2.num_computed_tokens == 0 and not low2.block_ids
    assert ids(sched.waiting) == ["low2"]
    assert ids(sched.running) == ["high", "low1"]  # running in priority order
    out = step(sched)
    assert rows(out) == [("high", 1), ("low1", 1)] and not out.preempted
    assert low2.output_token_ids == generated  # its tokens so far are kept, recomputed when it returns
    assert sched.num_preemptions == 1 and low2.num_preemptions == 1
    run_to_end(sched)


@pytest.mark.parametrize("running_priority, waiting_priority", [(0, 0), (-1, 0), (3, 3)])
def test_never_preempts_a_request_of_equal_or_higher_priority(running_priority, waiting_priority):
    sched = make_scheduler(max_num_seqs=2, scheduling="priority")
    sched.add_request(req("a", 3, 4, priority=running_priority))
    sched.add_request(req("b", 3, 4, priority=running_priority))
    step(sched)
    sched.add_request(req("c", 3, 2, priority=waiting_priority))
    outs = [step(sched) for _ in range(3)]
    assert not any(out.preempted for out in outs) and ids(sched.waiting) == ["c"]
    outs = run_to_end(sched)
    assert sched.num_preemptions == 0 and any(("c", 3) in rows(out) for out in outs)


def test_a_waiting_request_preempts_lower_priority_ones_for_blocks_lowest_first():
    # 8 blocks of 4 tokens; each low request holds 3 (11 tokens), the high one needs 3 for its 10-token prompt.
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=8, scheduling="priority")
    sched.add_request(req("p1", 10, 6, priority=1))
    sched.add_request(req("p2", 10, 6, priority=2))
    step(sched)
    step(sched)
    assert sched.block_manager.num_free_blocks == 2
    sched.add_request(req("high", 10, 4, priority=0))
    out = step(sched)
    assert [r.request_id for r in out.preempted] == ["p2"]  # the lowest priority goes, even though it is not the newest
    assert ("high", 10) in rows(out) and sched.requests["p1"].status == RequestStatus.RUNNING  # in the same step
    run_to_end(sched)


def test_when_blocks_run_out_the_lowest_priority_running_request_is_the_victim():
    """A request admitted later with a higher priority keeps its blocks; under fcfs it would go."""
    for policy, victim in (("priority", "low"), ("fcfs", "high")):
        sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=4, scheduling=policy)
        sched.add_request(req("low", 7, 6, priority=3))
        step(sched)
        sched.add_request(req("high", 7, 6, priority=-2))
        step(sched)  # 2 blocks each: 8 tokens of room, both at 8 tokens after this step
        assert sched.block_manager.num_free_blocks == 0
        out = step(sched)  # both need a third block
        assert [r.request_id for r in out.preempted] == [victim], policy
        run_to_end(sched)


def test_a_preempted_request_waits_at_its_priority_and_arrival_place():
    sched = make_scheduler(max_num_seqs=1, scheduling="priority")
    sched.add_request(req("mid", 3, priority=2))
    step(sched)
    sched.add_request(req("lowest", 3, priority=9))
    sched.add_request(req("high", 3, priority=0))
    sched.add_request(req("high2", 3, priority=0))
    out = step(sched)
    assert [r.request_id for r in out.preempted] == ["mid"] and rows(out) == [("high", 3)]  # its seat, at once
    assert ids(sched.waiting) == ["high2", "mid", "lowest"]  # not first (fcfs's place), not last
    run_to_end(sched)


def test_a_step_that_preempted_for_priority_admits_only_priorities_above_its_victims():
    """``_admit_waiting``'s ``ahead_of``: with free seats, budget and blocks for everyone, only the
    waiting requests of a priority above (a smaller number than) the victims' highest are admitted;
    the victim's priority and lower ones wait for the next step."""
    from replica.core.scheduler_output import SchedulerOutput

    sched = make_scheduler(max_num_seqs=8, scheduling="priority")
    for rid, priority in (("p0", 0), ("p1", 1), ("p2", 2)):
        sched.add_request(req(rid, 3, priority=priority))
    out = SchedulerOutput(step=1)
    sched._admit_waiting(out, sched.max_num_batched_tokens, ahead_of=1)
    assert rows(out) == [("p0", 3)] and ids(sched.waiting) == ["p1", "p2"]
    run_to_end(sched)


def test_static_batching_orders_its_queue_by_priority_and_never_preempts_for_it():
    sched = make_scheduler(max_num_seqs=2, policy="static", scheduling="priority")
    for rid, priority in (("a", 1), ("b", 1), ("c", 0)):
        sched.add_request(req(rid, 3, 3, priority=priority))
    out = step(sched)
    assert rows(out) == [("c", 3), ("a", 3)]
    sched.add_request(req("d", 3, 3, priority=-5))
    outs = [step(sched) for _ in range(2)]
    assert not any(o.preempted for o in outs) and ids(sched.waiting) == ["d", "b"]
    run_to_end(sched)


@pytest.mark.parametrize("seed", range(6))
def test_mixed_priorities_under_pressure_all_finish(seed):
    """Random arrivals of random priorities into few seats and blocks: every request ends with all
    its tokens, a step's victims are always the lowest ``(priority, arrival)`` of the running
    requests, and the pool ends free (no livelock: the step count stays bounded)."""
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=12, block_size=4, max_num_seqs=3, max_num_batched_tokens=16, scheduling="priority")
    pending = [req(f"r{i}", rng.randint(2, 14), rng.randint(4, 16), priority=rng.choice([-1, 0, 0, 2])) for i in range(14)]
    arrivals = sorted(rng.sample(range(30), len(pending)))
    done, tick = {}, 0
    while pending or sched.has_unfinished_requests():
        while pending and arrivals[0] <= tick:
            arrivals.pop(0)
            sched.add_request(pending.pop(0))
        out = step(sched)
        if out.preempted and sched.running:  # the victims were the lowest (priority, arrival) of the running
            assert max(key(r) for r in sched.running) < min(key(v) for v in out.preempted)
        for s in out.scheduled:
            if s.request.is_finished:
                done[s.request.request_id] = s.request
        assert_blocks_consistent(sched)
        tick += 1
        assert tick < 3000, "livelock"
    assert len(done) == 14 and sched.num_preemptions > 0
    assert all(r.num_output_tokens == r.sampling_params.max_tokens for r in done.values())
    assert sched.block_manager.num_used_blocks == 0


def key(request) -> tuple[int, float]:
    return request.priority, request.arrival_time


def test_priority_counts_are_bounded_and_never_count_too_few():
    requests = [req(f"r{i}", 2, priority=p) for i, p in enumerate([0, 0, -1, 5, 3, 3, 7])]
    assert priority_counts(requests) == ((-1, 1), (0, 2), (3, 2), (5, 1), (7, 1))
    # Past the limit, the highest values are counted under the lowest of them.
    assert priority_counts(requests, limit=3) == ((-1, 1), (0, 2), (3, 4))
    assert priority_counts([]) == ()


def test_async_scheduling_a_seat_the_step_in_flight_frees_is_taken_without_preempting():
    """With async scheduling, a request whose last token is in flight gives its seat up in the next
    step: a waiting request of higher priority takes that seat and preempts nobody."""
    sched = make_scheduler(max_num_seqs=2, scheduling="priority")
    sched.add_request(req("ending", 3, 2, priority=5))
    sched.add_request(req("long", 3, 50, priority=5))
    first = sched.schedule()
    sched.advance(first)
    second = sched.schedule()  # scheduled while the first is in flight: "ending" computes its last token
    sched.advance(second)
    sched.update_from_output(first, [1000, 1000], advanced=True)
    sched.add_request(req("high", 3, 2, priority=0))
    third = sched.schedule()
    assert not third.preempted and ("high", 3) in rows(third)
    sched.advance(third)
    sched.update_from_output(second, [1000, 1000], advanced=True)
    assert sched.requests.get("ending") is None  # its last token was read: done
    sched.update_from_output(third, [1000] * len(third.scheduled), advanced=True)
    while sched.has_unfinished_requests():
        step(sched)
    assert sched.num_preemptions == 0 and sched.block_manager.num_used_blocks == 0
    assert_blocks_consistent(sched)


def test_the_queue_wait_is_the_oldest_waiting_request_s_not_the_head_s():
    """Under ``priority`` the queue's head is the most urgent request, not the one that has waited
    longest: the reported wait (what the autoscaler scales on) is the oldest one's."""
    from replica.engine.stats import EngineStats

    sched = make_scheduler(max_num_seqs=1, scheduling="priority")
    sched.add_request(req("running", 3))
    step(sched)
    old, urgent = req("old", 3, priority=5), req("urgent", 3, priority=-1)
    old.arrival_time, urgent.arrival_time = 1.0, 99.0
    sched.add_request(old)
    sched.add_request(urgent)
    assert ids(sched.waiting) == ["urgent", "old"]
    assert EngineStats.of(sched, sched.block_manager).queue_wait_s(100.0) == pytest.approx(99.0)
