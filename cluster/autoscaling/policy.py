"""The Carpool autoscaling policy: replicas on seats taken, queue wait and KV use, not request counts.

Ray Serve's controller calls :class:`CarpoolAutoscalingPolicy` (a class-callable custom policy,
``AutoscalingPolicy(policy_function=..., policy_kwargs=...)``, Serve ≥ 2.50) on every control-loop
tick with an ``AutoscalingContext``: the replicas' own reports
(``LLMReplica.record_autoscaling_stats``: ``num_running``, ``num_slots``, ``num_waiting``,
``queue_wait_s``, ``kv_cache_usage``), each averaged over ``look_back_period_s``
(``ctx.aggregated_metrics``), and the current and target replica counts. It returns the target
count; Serve bounds it by ``min_replicas``/``max_replicas``. The rules are
:class:`~cluster.autoscaling.settings.AutoscalingSettings`'s; :func:`decide` is the decision
alone (a pure function of the inputs, the settings, the time and the state it returns).

Why not ongoing requests (Serve's default): a request count says nothing of how long a request
holds its seat. 30 one-token requests pass through 8 seats in a few steps, while 8 requests of
2,000 tokens hold them for minutes and leave the next ones waiting; llm-d's and Dynamo's
autoscalers scale on KV use and queueing for the same reason.

Each decision also goes to the app's :class:`~router.autoscaler_record.AutoscalerRecord` (a
small Ray actor), from which the ingress's ``/metrics`` exports it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from router.autoscaler_record import REASONS  # every reason a decision may give

__all__ = ["REASONS", "CarpoolAutoscalingPolicy", "Decision", "Load", "decide"]


@dataclass(frozen=True)
class Load:
    """What the replicas report, over the look-back window.

    Attributes:
        replicas: replicas that reported.
        running: requests holding a seat, summed over those replicas.
        seats: seats (``max_num_seqs``), summed.
        waiting: requests waiting for a seat, summed.
        queue_wait_s: the longest head-of-queue wait of any replica (seconds).
        kv_cache_usage: the fraction of KV blocks in use, the replicas' mean (0 to 1): a new
            replica lowers it by taking new requests, where one replica's own use would stay
            high until its long requests end.
        ongoing: requests Serve counts as running or queued for the deployment (its own metric).
    """

    replicas: int
    running: float
    seats: float
    waiting: float
    queue_wait_s: float
    kv_cache_usage: float
    ongoing: float

    @property
    def seat_utilization(self) -> float:
        """Running requests / seats (0 with no seats)."""
        return self.running / self.seats if self.seats else 0.0

    @classmethod
    def from_metrics(cls, metrics: dict[str, dict[Any, float]] | None, ongoing: float) -> "Load":
        """From Serve's ``ctx.aggregated_metrics`` (metric name → replica → window average)."""
        metrics = metrics or {}

        def per_replica(name: str) -> dict[Any, float]:
            return {r: float(v) for r, v in (metrics.get(name) or {}).items() if v is not None and math.isfinite(v)}

        slots = per_replica("num_slots")
        return cls(
            replicas=len(slots),
            running=sum(per_replica("num_running").values()),
            seats=sum(slots.values()),
            waiting=sum(per_replica("num_waiting").values()),
            queue_wait_s=max(per_replica("queue_wait_s").values(), default=0.0),
            kv_cache_usage=_mean(per_replica("kv_cache_usage").values()),
            ongoing=float(ongoing or 0.0),
        )


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


@dataclass(frozen=True)
class Decision:
    """A decision: the target replica count, why, and the state to pass to the next call."""

    target: int
    reason: str
    state: dict[str, Any]


def decide(
    load: Load, current: int, target: int, low: int, high: int, settings: dict[str, float], state: dict[str, Any], now: float
) -> Decision:
    """The target replica count for ``load``.

    Args:
        load: the replicas' reports (:class:`Load`).
        current: replicas running now; ``target``: the count Serve is moving to.
        low, high: the bounds (``min_replicas``, ``max_replicas``, as Serve adjusts them).
        settings: ``AutoscalingSettings.carpool_kwargs()``.
        state: the previous decision's ``state`` (``{}`` at first).
        now: seconds (``time.time()``).
    Returns:
        the :class:`Decision`; its ``state`` holds ``up_since``/``down_since`` (when the current
        need began) and ``changed_at`` (the last change of target).

    Rules, in order: no replica reported yet → hold; a change less than ``cooldown_s`` ago →
    hold; up-pressure (seats ≥ ``target_seat_utilization`` with queue wait ≥ ``target_queue_wait_s``,
    or KV ≥ ``target_kv_cache_usage``) → after ``upscale_delay_s`` of it, and not while a replica
    is still starting, the count that running + waiting requests need at
    ``target_seat_utilization`` (at least one more); room to shrink (running requests fit on fewer
    replicas at ``downscale_seat_utilization``, no queue wait, no KV pressure; or, with
    ``min_replicas`` 0, no request at all) → after ``downscale_delay_s``, that count (to 0 only
    from 1, as Serve allows it).
    """
    state = dict(state)
    up_since, down_since = state.get("up_since"), state.get("down_since")
    changed_at = state.get("changed_at")

    def hold(reason: str) -> Decision:
        return Decision(target, reason, {**state, "up_since": up_since, "down_since": down_since})

    def change(count: int, reason: str) -> Decision:
        count = max(low, min(high, count))
        if count == target:
            return hold("within_targets")
        return Decision(count, reason, {"changed_at": now, "up_since": None, "down_since": None})

    if target == 0 and current == 0:  # scaled to zero: Serve's cold start brings one back on a request
        up_since = down_since = None
        return hold("idle")
    if load.replicas == 0:
        return hold("no_reports")
    per_replica = load.seats / load.replicas
    full = load.seat_utilization >= settings["target_seat_utilization"] and load.queue_wait_s >= settings["target_queue_wait_s"]
    kv_full = load.kv_cache_usage >= settings["target_kv_cache_usage"]
    needed_up = math.ceil((load.running + load.waiting) / (per_replica * settings["target_seat_utilization"]) - 1e-9)
    fits_on = max(1, math.ceil(load.running / (per_replica * settings["downscale_seat_utilization"]) - 1e-9))
    idle = load.running == 0 and load.waiting == 0 and load.ongoing == 0
    quiet = load.queue_wait_s < settings["target_queue_wait_s"] and not kv_full
    want_up = (full or kv_full) and target < high
    want_down = not want_up and target > low and quiet and (fits_on < target or (idle and low == 0))
    up_since = (up_since if up_since is not None else now) if want_up else None
    down_since = (down_since if down_since is not None else now) if want_down else None
    if changed_at is not None and now - changed_at < settings["cooldown_s"]:
        return hold("cooldown")
    if want_up:
        if current < target:
            return hold("replicas_starting")
        if now - up_since < settings["upscale_delay_s"]:
            return hold("up_delay")
        return change(max(target + 1, needed_up), "seats_full_and_waiting" if full else "kv_cache_full")
    if want_down:
        if now - down_since < settings["downscale_delay_s"]:
            return hold("down_delay")
        if idle and low == 0:  # to 0 from 1 only, as Serve applies it (its rule): 1 first
            return change(0 if target == 1 else 1, "idle")
        return change(fits_on, "seats_underused")
    return hold("within_targets")


class CarpoolAutoscalingPolicy:
    """Serve's class-callable policy: ``policy(ctx) -> (target replicas, policy state)``.

    Args: the settings of ``AutoscalingSettings.carpool_kwargs()`` (Serve passes ``policy_kwargs``).
    """

    def __init__(self, **settings: float) -> None:
        self.settings = settings
        self._record = None  # the app's AutoscalerRecord actor, made on first use (this handle owns it)
        self._sent = None  # the last update's ObjectRef: a dead actor shows only in its result
        self._last_sent: tuple | None = None
        self._last_sent_at = 0.0

    def __call__(self, ctx) -> tuple[int, dict[str, Any]]:
        now = ctx.current_time or time.time()
        load = Load.from_metrics(ctx.aggregated_metrics, ctx.total_num_requests)
        state = {k: ctx.policy_state.get(k) for k in ("up_since", "down_since", "changed_at")}
        decision = decide(
            load, ctx.current_num_replicas, ctx.target_num_replicas,
            ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas, self.settings, state, now,
        )
        self._report(ctx, load, decision, now)
        return decision.target, {**ctx.policy_state, **decision.state}

    def _report(self, ctx, load: Load, decision: Decision, now: float) -> None:
        """Send the decision to the app's record when something changed, or once a second; a
        failure to reach it never affects scaling."""
        key = (decision.target, decision.reason, ctx.current_num_replicas, ctx.target_num_replicas)
        if key == self._last_sent and now - self._last_sent_at < 1.0:
            return
        try:
            import ray

            if not ray.is_initialized():  # called outside a Ray cluster (a unit test): nothing to report to
                return
            from router.autoscaler_record import record_actor

            if self._sent is not None and ray.wait([self._sent], timeout=0)[0]:
                try:
                    ray.get(self._sent, timeout=0)
                except Exception:  # the record died (killed for good): make a new one
                    self._record = None
            if self._record is None:
                self._record = record_actor(ctx.app_name, create=True)
            changed = decision.target != ctx.target_num_replicas
            self._sent = self._record.update.remote({
                "target_replicas": decision.target,
                "current_replicas": ctx.current_num_replicas,
                "min_replicas": ctx.capacity_adjusted_min_replicas,
                "max_replicas": ctx.capacity_adjusted_max_replicas,
                "seat_utilization": load.seat_utilization,
                "queue_wait_s": load.queue_wait_s,
                "kv_cache_usage": load.kv_cache_usage,
                "num_waiting": load.waiting,
                "reason": decision.reason,
                "direction": ("up" if decision.target > ctx.target_num_replicas else "down") if changed else None,
                "time": now,
            })
            self._last_sent, self._last_sent_at = key, now
        except Exception:  # the record is for people; scaling goes on without it (the handle is kept:
            pass  # it owns the actor, which dropping it would end)
