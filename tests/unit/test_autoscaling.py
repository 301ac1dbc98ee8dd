"""The Carpool autoscaling policy's decisions (``cluster/autoscaling/policy.py``), its settings, and
the policy as Serve's controller runs it (Serve's own wrapper and ``AutoscalingContext``).

The served behaviour, on a 2-node Ray cluster with the real model, is in
``tests/e2e/test_autoscaling.py``."""

from __future__ import annotations

import math
import random

import pytest
from pydantic import ValidationError

from cluster.autoscaling import AutoscalingSettings, parse_autoscale
from cluster.autoscaling.policy import REASONS, Load, decide
from cluster.config import ServeConfig, format_validation_error
from tests.unit.autoscaling_sim import Bursts, ClosedLoop, Poisson, Rounds, Sample, Sim

SETTINGS = AutoscalingSettings(max_replicas=4).carpool_kwargs()  # the defaults
SEATS = 8


def load(replicas: int, running: float, waiting: float = 0, wait_s: float = 0.0, kv: float = 0.1, ongoing=None,
         queued: float = 0.0) -> Load:
    return Load(
        replicas=replicas, running=running, seats=SEATS * replicas, waiting=waiting, queue_wait_s=wait_s,
        kv_cache_usage=kv, ongoing=running + waiting + queued if ongoing is None else ongoing, queued=queued,
    )


def run(loads, current=1, low=1, high=4, settings=SETTINGS, start=1000.0, step=1.0):
    """Feed ``loads`` (a callable of the replica count, or one Load) once per ``step`` seconds;
    replicas follow the target at once. Returns [(time, target, reason)] of every call."""
    state, target, out = {}, current, []
    for i in range(loads[1] if isinstance(loads, tuple) else 600):
        now = start + i * step
        current_load = loads[0](target) if isinstance(loads, tuple) else loads(target)
        d = decide(current_load, target, target, low, high, settings, state, now)
        state, target = d.state, d.target
        out.append((now, target, d.reason))
    return out


def changes(trace):
    return [(t, n) for (t, n, _), (_, before, _) in zip(trace[1:], trace) if n != before]


def test_full_seats_with_waiting_requests_scale_up_after_the_delay():
    busy = load(1, running=SEATS, waiting=6, wait_s=3.0)
    first = decide(busy, 1, 1, 1, 4, SETTINGS, {}, 0.0)
    assert (first.target, first.reason) == (1, "up_delay")
    later = decide(busy, 1, 1, 1, 4, SETTINGS, first.state, SETTINGS["upscale_delay_s"])
    # running + waiting = 14 requests need ceil(14 / (8 * 0.9)) = 2 replicas
    assert (later.target, later.reason) == (2, "seats_full_and_waiting")


def test_demand_and_not_seat_utilization_scales_up_rounds():
    """The operator's round (issue 54): 10 requests on 4 seats in three waves (4, 4, 2 running;
    6, 2, 0 waiting): running / seats averages 0.83, under the 0.9 target, but the demand of
    running + waiting requests (6) is 1.5 times the seats and the round's waits reached 8.6 s."""
    rounds = Load(replicas=1, running=10 / 3, seats=4, waiting=8 / 3, queue_wait_s=8.6, kv_cache_usage=0.2, ongoing=6)
    assert rounds.seat_utilization < SETTINGS["target_seat_utilization"]
    d = decide(rounds, 1, 1, 1, 2, SETTINGS, {"up_since": 0.0}, SETTINGS["upscale_delay_s"])
    assert (d.target, d.reason) == (2, "seats_full_and_waiting")


def test_requests_queued_at_the_handles_count_as_demand():
    # Every seat taken, nothing in the engine's queue, 14 requests held in Serve's router.
    held = load(1, running=SEATS, queued=14, wait_s=2.0)
    d = decide(held, 1, 1, 1, 4, SETTINGS, {"up_since": 0.0}, 1e6)
    assert d.target == math.ceil(22 / (SEATS * SETTINGS["target_seat_utilization"]))  # 4
    # and they block a scale-down however few run
    assert decide(load(2, running=1, queued=6), 2, 2, 1, 4, SETTINGS, {"down_since": 0.0}, 1e6).target == 2


def test_many_tiny_requests_without_waits_do_not_scale_up():
    # 30 requests in flight (Serve's count), seats half used, nobody waits a second.
    tiny = load(1, running=4, waiting=2, wait_s=0.05, ongoing=30)
    trace = run(lambda n: tiny, high=4)
    assert changes(trace) == []
    assert {reason for _, _, reason in trace} == {"within_targets"}


def test_full_seats_without_waits_hold():
    # Every seat taken but no request waits: adding a replica would not help anyone yet.
    assert decide(load(1, SEATS, 0, 0.0), 1, 1, 1, 4, SETTINGS, {}, 0.0).reason == "within_targets"


def test_a_nearly_full_kv_pool_scales_up():
    kv = load(1, running=3, kv=0.97)
    d = decide(kv, 1, 1, 1, 4, SETTINGS, {"up_since": 0.0}, 100.0)
    assert (d.target, d.reason) == (2, "kv_cache_full")


def test_underused_seats_scale_down_after_the_delay_never_below_min():
    quiet = load(3, running=3)  # fits on one replica at 0.5 utilization: 3 <= 8 * 0.5
    assert decide(quiet, 3, 3, 1, 4, SETTINGS, {}, 0.0).reason == "down_delay"
    d = decide(quiet, 3, 3, 1, 4, SETTINGS, {"down_since": 0.0}, SETTINGS["downscale_delay_s"])
    assert (d.target, d.reason) == (1, "seats_underused")
    assert decide(quiet, 3, 3, 3, 4, SETTINGS, {"down_since": 0.0}, 1e6).target == 3  # min_replicas 3


def test_no_scale_down_while_requests_wait():
    waiting = load(2, running=2, waiting=1, wait_s=2.0)
    d = decide(waiting, 2, 2, 1, 4, SETTINGS, {"down_since": 0.0}, 1e6)
    assert d.target == 2


def test_scale_to_zero_only_with_min_zero_and_no_request():
    idle = load(1, running=0, ongoing=0)
    assert decide(idle, 1, 1, 1, 4, SETTINGS, {"down_since": 0.0}, 1e6).target == 1  # min 1
    d = decide(idle, 1, 1, 0, 4, SETTINGS, {"down_since": 0.0}, 1e6)
    assert (d.target, d.reason) == (0, "idle")
    handle_queue = load(1, running=0, ongoing=1)  # a request queued at the handle: not idle
    assert decide(handle_queue, 1, 1, 0, 4, SETTINGS, {"down_since": 0.0}, 1e6).target == 1
    assert decide(Load(0, 0, 0, 0, 0, 0, 0), 0, 0, 0, 4, SETTINGS, {}, 1e6).target == 0


def test_to_zero_goes_through_one_as_serve_applies_it():
    idle = load(3, running=0, ongoing=0)
    d = decide(idle, 3, 3, 0, 4, SETTINGS, {"down_since": 0.0}, 1e6)
    assert (d.target, d.reason) == (1, "idle")  # what the policy reports is what Serve does


def test_one_replica_full_of_long_requests_does_not_pile_up_replicas():
    """KV use is the replicas' mean: a replica that holds long requests keeps its own use high
    until they end, which more replicas cannot change."""
    from cluster.autoscaling.policy import Load

    metrics = {
        "num_slots": {"a": 8.0, "b": 8.0}, "num_running": {"a": 2.0, "b": 0.0}, "num_waiting": {"a": 0.0, "b": 0.0},
        "queue_wait_s": {"a": 0.0, "b": 0.0}, "kv_cache_usage": {"a": 0.97, "b": 0.05},
    }
    lopsided = Load.from_metrics(metrics, ongoing=2)
    assert lopsided.kv_cache_usage == pytest.approx(0.51)
    d = decide(lopsided, 2, 2, 1, 4, SETTINGS, {"down_since": 0.0}, 1e6)
    assert (d.target, d.reason) == (1, "seats_underused")


def test_cooldown_holds_every_decision_after_a_change():
    busy = load(2, running=2 * SEATS, waiting=10, wait_s=5.0)
    state = {"changed_at": 100.0, "up_since": 0.0}
    d = decide(busy, 2, 2, 1, 4, SETTINGS, state, 100.0 + SETTINGS["cooldown_s"] - 1)
    assert (d.target, d.reason) == (2, "cooldown")
    assert decide(busy, 2, 2, 1, 4, SETTINGS, d.state, 100.0 + SETTINGS["cooldown_s"]).target > 2


def test_no_second_scale_up_while_a_replica_starts():
    busy = load(1, running=SEATS, waiting=8, wait_s=5.0)
    d = decide(busy, current=1, target=2, low=1, high=4, settings=SETTINGS, state={"up_since": 0.0}, now=1e6)
    assert (d.target, d.reason) == (2, "replicas_starting")


def test_bounds_and_no_reports():
    huge = load(1, running=SEATS, waiting=500, wait_s=60.0)
    assert decide(huge, 1, 1, 1, 3, SETTINGS, {"up_since": 0.0}, 1e6).target == 3  # at most max_replicas
    assert decide(Load(0, 0, 0, 0, 0, 0, 5), 1, 1, 1, 3, SETTINGS, {}, 1e6).reason == "no_reports"


@pytest.mark.parametrize("requests", range(0, 4 * SEATS + 1, 3))
def test_a_steady_load_converges_without_flapping(requests):
    """A fixed number of requests, each replica taking up to SEATS of them, the rest waiting (a
    second each): whatever the count, the target moves one way and then stays; two changes are
    never closer than the cooldown."""

    def steady(n: int) -> Load:
        running = min(requests, n * SEATS)
        waiting = requests - running
        return load(n, running, waiting, wait_s=2.0 if waiting else 0.0)

    trace = run(steady, current=1, high=4)
    moved = changes(trace)
    directions = {b > a for (_, a), (_, b) in zip([(0, 1)] + moved, moved)}
    assert len(directions) <= 1, moved  # never up then down, or down then up
    assert all(t2 - t1 >= SETTINGS["cooldown_s"] for (t1, _), (t2, _) in zip(moved, moved[1:])), moved


def test_noise_around_the_thresholds_gives_at_most_one_decision_per_cooldown():
    """Seat use and waits jumping around both thresholds every second for an hour."""
    rng = random.Random(0)

    def noisy(n: int) -> Load:
        running = rng.uniform(0.4, 1.0) * n * SEATS
        return load(n, running, rng.choice([0, 2]), wait_s=rng.uniform(0.0, 2.0), kv=rng.uniform(0.5, 0.97))

    trace = run((noisy, 3600), current=2, high=4)
    moved = changes(trace)
    assert all(t2 - t1 >= SETTINGS["cooldown_s"] for (t1, _), (t2, _) in zip(moved, moved[1:])), moved
    assert len(moved) <= 3600 / SETTINGS["cooldown_s"]
    assert {reason for _, _, reason in trace} <= set(REASONS)


# ---- simulated metric streams (tests/unit/autoscaling_sim.py): 4 seats a replica, 300-token requests ----
GPU_STEP_S = 0.014  # ~70 tokens/s a sequence: a 300-token request holds its seat 4.2 s, as the operator's did
CPU_STEP_S = 0.1  # a 2-core CPU: 30 s


def assert_no_flapping(sim: Sim) -> None:
    moved = sim.changes()
    assert len({to > before for _, before, to in moved}) <= 1, moved  # one way only while the load holds
    assert all(t2 - t1 >= SETTINGS["cooldown_s"] for (t1, *_), (t2, *_) in zip(moved, moved[1:])), moved


@pytest.mark.parametrize("step_s", [GPU_STEP_S, CPU_STEP_S])
def test_rounds_of_ten_long_requests_on_four_seats_scale_up(step_s):
    """The operator's load (issue 54): 10 clients, 300-token completions, in rounds of 10 (the next
    round once all ended), on ``--autoscale 1:2 --max-num-seqs 4``."""
    if step_s == GPU_STEP_S:  # the issue as measured: seat use never reached the old 0.9 target
        alone = Sim(SETTINGS, step_s=step_s, high=1).run(Rounds(), 200)
        assert max(l.seat_utilization for t, _, _, l in alone.decisions if t >= 30) < SETTINGS["target_seat_utilization"]
        assert alone.wait_quantile(0, q=1.0) > 8.0
    sim = Sim(SETTINGS, step_s=step_s, high=2).run(Rounds(), 300)
    assert [(before, to) for _, before, to in sim.changes()] == [(1, 2)]
    assert sim.changes()[0][0] <= 2 * SETTINGS["upscale_delay_s"]
    # 1:4: sized to the demand (6 on average: 2 replicas at this step rate, 3 at the CPU's, where the
    # first round's 10 fill the early window), not one replica after another
    wide = Sim(SETTINGS, step_s=step_s, high=4).run(Rounds(), 600)
    assert len(wide.changes()) == 1 and wide.target in (2, 3), wide.changes()


def test_rounds_then_quiet_scale_back_down_once():
    sim = Sim(SETTINGS, step_s=GPU_STEP_S, high=2).run(Rounds(until=200), 600)
    (up_t, *up), (down_t, *down) = sim.changes()
    assert (up, down) == ([1, 2], [2, 1])
    assert down_t >= 200 + SETTINGS["downscale_delay_s"]  # the load ended at 200 s


@pytest.mark.parametrize("step_s", [GPU_STEP_S, CPU_STEP_S])
def test_open_loop_poisson_at_one_and_a_half_times_capacity(step_s):
    capacity = 4 / (301 * step_s)  # requests a second one replica's 4 seats finish
    sim = Sim(SETTINGS, step_s=step_s, high=4).run(Poisson(1.5 * capacity), 900)
    moved = sim.changes()
    assert moved and moved[0][0] <= 90, moved  # the queue builds up slowly: 0.5 x capacity a second
    assert_no_flapping(sim)
    assert sim.target >= 2
    assert sim.wait_quantile(700) < SETTINGS["target_queue_wait_s"]  # the backlog served, waits gone


@pytest.mark.parametrize("clients", range(2, 12))
def test_a_steady_closed_loop_load_changes_once_at_most(clients):
    """``clients`` back-to-back clients for half an hour: at or under the seats (4) nobody waits and
    nothing changes; over them (steady overload) one step up to ⌈clients / (0.9 x 4)⌉, then no other."""
    sim = Sim(SETTINGS, step_s=CPU_STEP_S, high=4).run(ClosedLoop(clients), 1800)
    expected = 1 if clients <= 4 else min(4, math.ceil(clients / (4 * SETTINGS["target_seat_utilization"])))
    assert sim.target == expected
    assert len(sim.changes()) == (expected != 1), sim.changes()
    if expected > 1:
        assert sim.wait_quantile(sim.changes()[0][0] + 120) < SETTINGS["target_queue_wait_s"]


@pytest.mark.parametrize("shape, step_s, peak_wait_past_target", [
    (lambda: ClosedLoop(12, tokens=2), GPU_STEP_S, False),  # the bench's burst: 12 clients of 2-token requests
    (lambda: ClosedLoop(12, tokens=2), CPU_STEP_S, False),
    (lambda: Bursts(30, tokens=2, every_s=5), GPU_STEP_S, False),  # 30 at once every 5 s
    (lambda: Bursts(200, tokens=2, every_s=60), GPU_STEP_S, True),  # 200 at once a minute: 2 s waits, briefly
], ids=["closed-gpu", "closed-cpu", "bursts-30", "bursts-200"])
def test_bursts_of_tiny_requests_do_not_scale(shape, step_s, peak_wait_past_target):
    """Many more requests than seats, each through in 3 steps: the seats turn over and the wait's
    quantile stays under the target; a burst whose waits pass it for a second or two a minute is
    one sample of the window, which the quantile leaves out (the window's max would scale)."""
    sim = Sim(SETTINGS, step_s=step_s, high=4).run(shape(), 600)
    assert max(l.demand for *_, l in sim.decisions) > 2 * 4
    assert (sim.wait_quantile(0, q=1.0) > SETTINGS["target_queue_wait_s"]) == peak_wait_past_target
    assert sim.changes() == []
    assert {reason for _, _, reason, _ in sim.decisions} <= {"within_targets", "up_delay"}


def test_load_from_serve_metrics_sums_seats_and_takes_the_worst_wait():
    metrics = {
        "num_slots": {"a": 8.0, "b": 8.0}, "num_running": {"a": 8.0, "b": 4.0}, "num_waiting": {"a": 3.0, "b": 0.0},
        "queue_wait_s": {"a": 2.5, "b": 0.0}, "kv_cache_usage": {"a": 0.5, "b": float("nan")},
    }
    got = Load.from_metrics(metrics, ongoing=15, queued=2.0)
    assert (got.replicas, got.running, got.seats, got.waiting, got.queue_wait_s, got.kv_cache_usage) == (2, 12, 16, 3, 2.5, 0.5)
    assert (got.seat_utilization, got.queued, got.demand) == (0.75, 2.0, 17.0)
    assert Load.from_metrics(None, 0, queued=None).replicas == 0


def test_the_wait_is_a_high_quantile_of_the_windows_samples_not_its_mean():
    metrics = {"num_slots": {"a": 4.0, "b": 4.0}, "queue_wait_s": {"a": 3.2, "b": 0.4}}

    def raw(a: list[float], b: list[float], start: float = 100.0) -> dict:
        return {"queue_wait_s": {"a": [Sample(start + 2 * i, v) for i, v in enumerate(a)],
                                 "b": [Sample(start + 2 * i, v) for i, v in enumerate(b)]}}

    # a round: 6 of 15 samples at 8 s, the rest 0 (mean 3.2): the quantile keeps the 8 s
    rounds = raw([8.0] * 6 + [0.0] * 9, [0.4] * 15)
    assert Load.from_metrics(metrics, 0, raw=rounds).queue_wait_s == 8.0
    # one sample of a burst in 15: the quantile leaves it out (its max would not)
    spike = raw([0.0] * 14 + [5.0], [0.4] * 15)
    assert Load.from_metrics(metrics, 0, raw=spike).queue_wait_s == 0.4
    # samples older than the window are left out; no samples: the window average
    assert Load.from_metrics(metrics, 0, raw=raw([9.0] * 5 + [0.5] * 10, [0.0] * 15), since=110.0).queue_wait_s == 0.5
    assert Load.from_metrics(metrics, 0, raw=None).queue_wait_s == 3.2


def test_the_policy_runs_under_serves_wrapper_with_a_context():
    """As Serve's controller runs it: the class from the import path Serve serializes, its
    ``policy_kwargs``, Serve's wrapper (bounds, delays at 0), a real ``AutoscalingContext``."""
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve._private.common import DeploymentID
    from ray.serve._private.common import TimeStampedValue
    from ray.serve.autoscaling_policy import _apply_autoscaling_config
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    settings = AutoscalingSettings(max_replicas=3, upscale_delay_s=0, cooldown_s=0, look_back_period_s=20)
    config = AutoscalingConfig(**settings.serve_options())
    policy = _apply_autoscaling_config(_resolve_policy_callable(config.policy))

    def context(running: dict, waiting: dict, wait: dict, state: dict, target: int = 1, queued: float = 0.0) -> AutoscalingContext:
        replicas = list(running)
        return AutoscalingContext(
            deployment_id=DeploymentID(name="LLMReplica", app_name="t"), deployment_name="LLMReplica", app_name="t",
            current_num_replicas=len(replicas), target_num_replicas=target, running_replicas=replicas,
            total_num_requests=sum(running.values()) + sum(waiting.values()) + queued, total_queued_requests=queued,
            aggregated_metrics={
                "num_slots": {r: 4.0 for r in replicas}, "num_running": running, "num_waiting": waiting,
                "queue_wait_s": {r: w / 3 for r, w in wait.items()}, "kv_cache_usage": {r: 0.2 for r in replicas},
            },
            # a third of the window's samples at the wait; 5 samples at 9 s from before the window (30-50 s)
            raw_metrics={"queue_wait_s": {
                r: [TimeStampedValue(20.0 + i, 9.0) for i in range(5)] + [TimeStampedValue(40.0 + i, w if i < 3 else 0.0) for i in range(9)]
                for r, w in wait.items()
            }},
            capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=3,
            policy_state=state, last_scale_up_time=None, last_scale_down_time=None, current_time=50.0, config=config,
        )

    target, state = policy(context({"r1": 4.0}, {"r1": 6.0}, {"r1": 2.0}, {}))
    assert target == 3  # 10 requests at 0.9 of 4 seats need 3 replicas (the wait's mean, 0.67 s, would hold)
    assert policy(context({"r1": 3.0}, {"r1": 0.0}, {"r1": 2.0}, {}, queued=3.0))[0] == 2  # 6 with the handle's
    target, _ = policy(context({"r1": 4.0}, {"r1": 2.0}, {"r1": 0.0}, {}))
    assert target == 1  # demand 6, but nobody waited in the window (the 9 s samples are older)


def test_settings_refuse_bad_values_naming_them():
    def error(**fields) -> str:
        with pytest.raises(ValidationError) as info:
            ServeConfig(autoscaling=fields)
        return format_validation_error(info.value)

    assert "min_replicas (3) is above max_replicas (2)" in error(min_replicas=3, max_replicas=2)
    assert "autoscaling.target_queue_wait_s" in error(max_replicas=2, target_queue_wait_s=0)
    assert "autoscaling.target_seat_utilization" in error(max_replicas=2, target_seat_utilization=-0.5)
    assert "autoscaling.cooldown_s" in error(max_replicas=2, cooldown_s=-1)
    assert "target_ongoing_requests: not a setting of policy 'carpool'" in error(max_replicas=2, target_ongoing_requests=4)
    assert "target_queue_wait_s: not a setting of policy 'ongoing_requests'" in error(
        max_replicas=2, policy="ongoing_requests", target_queue_wait_s=1
    )
    assert "downscale_seat_utilization (0.95) must be below" in error(max_replicas=2, downscale_seat_utilization=0.95)
    assert "look_back_period_s (1) must be longer than metrics_interval_s (2)" in error(max_replicas=2, look_back_period_s=1)
    assert "initial_replicas (5)" in error(max_replicas=2, initial_replicas=5)
    assert "autoscaling.drain_timeout_s" in error(max_replicas=2, drain_timeout_s=float("inf"))
    assert "autoscaling.upscale_delay_s" in error(max_replicas=2, upscale_delay_s=float("inf"))
    with pytest.raises(ValidationError, match="not both"):
        ServeConfig(replicas=2, autoscaling={"max_replicas": 2})


def test_carpool_policy_goes_to_serve_with_its_own_delays():
    options = AutoscalingSettings(min_replicas=0, max_replicas=4, upscale_delay_s=5).serve_options()
    assert (options["upscale_delay_s"], options["downscale_delay_s"]) == (0.0, 0.0)  # the policy applies them
    assert options["policy"]["policy_function"] == "cluster.autoscaling.policy:CarpoolAutoscalingPolicy"
    assert options["policy"]["policy_kwargs"]["upscale_delay_s"] == 5
    assert options["min_replicas"] == 0


def test_autoscale_flag():
    from cluster.cli import build_config

    assert parse_autoscale("1:4") == {"min_replicas": 1, "max_replicas": 4}
    for bad in ("4", "a:b", "1:-2", ":3"):
        with pytest.raises(ValueError, match="--autoscale takes MIN:MAX"):
            parse_autoscale(bad)
    cfg = build_config(None, {}, {}, {"min_replicas": 0, "max_replicas": 2, "target_queue_wait_s": 0.5, "policy": None})
    assert (cfg.autoscaling.min_replicas, cfg.autoscaling.max_replicas, cfg.autoscaling.target_queue_wait_s) == (0, 2, 0.5)
    with pytest.raises(ValueError, match="--autoscale MIN:MAX"):
        build_config(None, {}, {}, {"target_queue_wait_s": 0.5})
    assert build_config(None, {}, {}, {"policy": None}).autoscaling is None


def test_health_is_ok_at_zero_replicas_only_when_autoscaled_there():
    """``/health`` at zero running replicas: 200 when autoscaling with min_replicas 0 took the app
    there (a request starts a replica; a load balancer must keep sending), 503 otherwise."""
    import asyncio
    import time

    from router.dispatch.replica_view import DeploymentView, ReplicaView

    def health(status: str, least) -> bool:
        view = ReplicaView(None, seats=4, waiting=4)
        view._view = DeploymentView(time.monotonic(), True, 0, status, 2, "replicas", least)  # a fresh look
        return asyncio.run(view.healthy())[0]

    assert health("HEALTHY", 0) and health("UPSCALING", 0)
    assert not health("HEALTHY", 1) and not health("HEALTHY", None)  # fixed count, or min 1: down
    assert not health("UNHEALTHY", 0)


def test_the_record_keeps_the_reason_of_the_last_change():
    from router.observability.autoscaler_record import AutoscalerRecord

    record = AutoscalerRecord("app")
    assert record.exposition() == ""  # no series before the first decision
    record.update({"target_replicas": 1, "reason": "up_delay", "direction": None})
    record.update({"target_replicas": 2, "reason": "seats_full_and_waiting", "direction": "up"})
    record.update({"target_replicas": 2, "reason": "cooldown", "direction": None})
    text = record.exposition()
    assert 'carpool:autoscaler_last_decision{application="app",reason="cooldown"} 1.0' in text
    assert 'carpool:autoscaler_last_change{application="app",reason="seats_full_and_waiting"} 1.0' in text
    assert 'carpool:autoscaler_decisions_total{application="app",direction="up"} 1.0' in text
    assert "_created" not in text
