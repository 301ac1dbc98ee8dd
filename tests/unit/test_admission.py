"""Admission by latency target (``replica/engine/admission.py``): the TTFT prediction's rules on
hand-made engine snapshots (free seat, full seats, the queue as a list scheduling, priorities,
more waiting than listed), the step cost's weighted mean, the targets' met/missed rule, and the
headers that carry the targets (``router/request/slo_headers.py``): each bad one a 400 naming it."""

from __future__ import annotations

import math

import pytest

from replica.engine.admission import (
    Admission, MAX_LISTED_WAITING, STEP_COST_WEIGHT, TARGET_HEADROOM, predict_ttft_s, steps_left, update_step_cost, would_miss,
)
from replica.engine.stats import EngineStats
from replica.protocol.envelope import RequestEnvelope, RoutingHints
from replica.protocol.errors import LatencyTargetError
from replica.protocol.sampling_params import SamplingParams
from replica.protocol.slo import LatencyTargets
from router.request.protocol import OpenAIError
from router.request.slo_headers import latency_targets


def snapshot(*, seats: int = 2, seat_steps=(), waiting=(), step_s: float | None = 0.1, budget: int = 64) -> EngineStats:
    return EngineStats(
        num_slots=seats, num_running=len(seat_steps), num_waiting=len(waiting), num_free_blocks=100,
        num_total_blocks=100, kv_cache_usage=0.0, num_preemptions=0, num_steps=10,
        step_time_s=step_s, token_budget=budget, seat_steps=tuple(sorted(seat_steps)), waiting_steps=tuple(waiting),
    )


def test_nothing_to_predict_from_before_the_first_timed_step_or_on_an_idle_engine():
    assert predict_ttft_s(snapshot(step_s=None, seat_steps=(5,)), 10) is None
    assert predict_ttft_s(snapshot(step_s=100.0), 10) is None  # idle: served at once, whatever the stale cost
    assert predict_ttft_s(snapshot(step_s=100.0), 10, unseen=((0, 3),)) == pytest.approx((1 + 1) * 100.0)


def test_a_free_seat_costs_the_step_in_flight_and_the_prefill_steps():
    # 1 running request takes 1 token of the 64-token budget: 63 per step; 100 tokens -> 2 steps,
    # after the step in flight
    assert predict_ttft_s(snapshot(seat_steps=(50,)), 100) == pytest.approx((1 + 2) * 0.1)
    assert predict_ttft_s(snapshot(seat_steps=(50,)), 63) == pytest.approx((1 + 1) * 0.1)


def test_full_seats_wait_for_the_first_seat_to_free():
    assert predict_ttft_s(snapshot(seat_steps=(30, 5)), 10) == pytest.approx((1 + 5 + 1) * 0.1)


def test_the_queue_is_list_scheduled_on_the_seats_in_order():
    # seats free at 5 and 30; waiting: 20 steps (takes the seat at 5, frees it at 25), then 100
    # steps (takes the one at 25, frees at 125): the new request gets the seat that frees at 30
    stats = snapshot(seat_steps=(30, 5), waiting=((0, 20), (0, 100)))
    assert predict_ttft_s(stats, 10) == pytest.approx((1 + 30 + 1) * 0.1)
    # one more waiting request of 1 step takes the seat at 30: then the next is 31
    stats = snapshot(seat_steps=(30, 5), waiting=((0, 20), (0, 100), (0, 1)))
    assert predict_ttft_s(stats, 10) == pytest.approx((1 + 31 + 1) * 0.1)


def test_requests_admitted_but_not_yet_in_the_snapshot_queue_after_the_listed_ones():
    stats = snapshot(seat_steps=(30, 5), waiting=((0, 20),))
    assert predict_ttft_s(stats, 10) == pytest.approx((1 + 25 + 1) * 0.1)
    assert predict_ttft_s(stats, 10, unseen=((0, 100),)) == pytest.approx((1 + 30 + 1) * 0.1)


def test_only_the_waiting_requests_that_run_first_count():
    stats = snapshot(seat_steps=(30, 5), waiting=((2, 20), (2, 100)))
    assert predict_ttft_s(stats, 10, priority=0) == pytest.approx((1 + 5 + 1) * 0.1)  # it overtakes both
    assert predict_ttft_s(stats, 10, priority=2) == pytest.approx((1 + 30 + 1) * 0.1)  # it waits behind both


def test_more_waiting_than_listed_is_infinitely_late():
    stats = snapshot(seat_steps=(3, 3), waiting=((0, 1),) * MAX_LISTED_WAITING)
    stats = EngineStats(**{**stats.__dict__, "num_waiting": MAX_LISTED_WAITING + 1})
    assert predict_ttft_s(stats, 10) == math.inf


def test_a_request_is_shed_past_the_headroom_of_its_target():
    assert not would_miss(None, 0.001)
    assert not would_miss(TARGET_HEADROOM * 2.0, 2.0) and would_miss(TARGET_HEADROOM * 2.0 + 1e-6, 2.0)


def test_steps_left_and_step_cost():
    assert steps_left(100, 20, 0, 64) == 2 + 19  # a new request: 2 prefill steps (the 2nd samples), 19 more tokens
    assert steps_left(64, 20, 0, 64) == 1 + 19
    assert steps_left(1, 20, 7, 64) == 13  # decoding: the last token's step samples the 8th of 20
    assert steps_left(0, 20, 20, 64) == 0
    assert steps_left(30, 0, 0, 64) == 1  # scores its prompt only
    assert steps_left(140, 20, 5, 64) == 3 + 14  # preempted: prompt and output again
    assert update_step_cost(None, 0.5) == 0.5
    assert update_step_cost(0.5, 1.5) == pytest.approx(0.5 + STEP_COST_WEIGHT * 1.0)


def test_targets_met_or_missed():
    both = LatencyTargets(ttft_s=1.0, tpot_s=0.1)
    assert both.met(0.9, 0.05) and both.met(1.0, None)
    assert not both.met(1.1, 0.05) and not both.met(0.5, 0.2)
    assert LatencyTargets(tpot_s=0.1).met(100.0, 0.1)


def test_headers_set_the_targets_in_seconds():
    assert latency_targets({}) is None
    assert latency_targets({"x-slo-ttft-ms": "2000"}) == LatencyTargets(ttft_s=2.0)
    assert latency_targets({"x-slo-ttft-ms": "250", "x-slo-tpot-ms": "50.5", "x-slo-shed": "True"}) == LatencyTargets(
        ttft_s=0.25, tpot_s=0.0505, shed=True
    )
    assert latency_targets({"x-slo-tpot-ms": "40", "x-slo-shed": "0"}) == LatencyTargets(tpot_s=0.04)
    assert latency_targets({"x-slo-ttft-ms": " 1500. "}) == LatencyTargets(ttft_s=1.5)


@pytest.mark.parametrize(
    "headers, param",
    [
        ({"x-slo-ttft-ms": "soon"}, "x-slo-ttft-ms"),
        ({"x-slo-ttft-ms": "0"}, "x-slo-ttft-ms"),
        ({"x-slo-ttft-ms": "-5"}, "x-slo-ttft-ms"),
        ({"x-slo-ttft-ms": "inf"}, "x-slo-ttft-ms"),
        ({"x-slo-tpot-ms": "nan"}, "x-slo-tpot-ms"),
        ({"x-slo-ttft-ms": "1_000"}, "x-slo-ttft-ms"),
        ({"x-slo-ttft-ms": "+50"}, "x-slo-ttft-ms"),
        ({"x-slo-ttft-ms": "1e3"}, "x-slo-ttft-ms"),
        ({"x-slo-ttft-ms": "9" * 5000}, "x-slo-ttft-ms"),  # not finite as a float; echoed cut short
        ({"x-slo-ttft-ms": ""}, "x-slo-ttft-ms"),
        ({"x-slo-ttft-ms": "100", "x-slo-shed": "maybe"}, "x-slo-shed"),
        ({"x-slo-shed": "true"}, "x-slo-shed"),
        ({"x-slo-tpot-ms": "10", "x-slo-shed": "true"}, "x-slo-shed"),
    ],
)
def test_a_bad_header_is_a_400_naming_it(headers, param):
    with pytest.raises(OpenAIError) as info:
        latency_targets(headers)
    assert info.value.status_code == 400 and info.value.param == param and param in info.value.message
    assert len(info.value.message) < 200


def envelope(request_id: str, prompt_len: int, max_tokens: int, slo: LatencyTargets | None = None) -> RequestEnvelope:
    prompt = list(range(3, 3 + prompt_len))
    return RequestEnvelope(request_id, prompt, SamplingParams(max_tokens=max_tokens), RoutingHints.of(prompt, 16), slo=slo)


def test_admission_counts_the_requests_it_admitted_that_the_snapshot_does_not_hold_yet():
    stats = snapshot(seat_steps=(30, 5))  # both seats held; one frees after 5 steps
    shed = []
    admission = Admission(lambda: stats, on_shed=lambda: shed.append(1))
    late = LatencyTargets(ttft_s=1.0, shed=True)
    for held in ("r1", "r2"):  # the two running requests, admitted earlier: the snapshot holds them
        admission.admit(envelope(held, 10, 30))
    admission.admit(envelope("a", 10, 100))  # no targets: admitted; it will take the seat that frees at 5
    with pytest.raises(LatencyTargetError) as info:
        admission.admit(envelope("b", 10, 4, late))  # behind "a": the seat at 30, (1 + 30 + 1) x 0.1 s
    assert info.value.predicted_s == pytest.approx(3.2) and info.value.target_s == 1.0 and shed == [1]
    admission.release("a")  # "a" ended (or the snapshot now holds it: then it is not unseen)
    admission.admit(envelope("b", 10, 4, late))  # (1 + 5 + 1) x 0.1 s = 0.7 s, within 0.85 s
    admission.release("b")
    admission.release("b")  # idempotent
    assert shed == [1]
