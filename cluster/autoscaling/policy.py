"""The Carpool autoscaling policy: replicas on demand for seats, queue wait and KV use, not request counts.

Ray Serve's controller calls :class:`CarpoolAutoscalingPolicy` (a class-callable custom policy,
``AutoscalingPolicy(policy_function=..., policy_kwargs=...)``, Serve ≥ 2.50) on every control-loop
tick with an ``AutoscalingContext`` (Serve 2.60: ``ray/serve/config.py``): the replicas' own
reports (``LLMReplica.record_autoscaling_stats``: ``num_running``, ``num_slots``, ``num_waiting``,
``queue_wait_s``, ``kv_cache_usage``), each averaged over ``look_back_period_s``
(``ctx.aggregated_metrics``) and as the window's samples (``ctx.raw_metrics``); the requests
queued in the handles' routers because no replica would take them (``ctx.total_queued_requests``,
window average); and the current and target replica counts. It returns the target count; Serve
bounds it by ``min_replicas``/``max_replicas``. The rules are
:class:`~cluster.autoscaling.settings.AutoscalingSettings`'s; :func:`decide` is the decision
alone (a pure function of the inputs, the settings, the time and the state it returns).

Why not ongoing requests (Serve's default): a request count says nothing of how long a request
holds its seat. 30 one-token requests pass through 8 seats in a few steps, while 8 requests of
2,000 tokens hold them for minutes and leave the next ones waiting; llm-d's and Dynamo's
autoscalers scale on KV use and queueing for the same reason.

Why demand and a high quantile of the wait, not seat utilization and the wait's mean (issue 54,
item 4): clients that send in rounds (10 requests of 300 tokens on 4 seats, the next round once
all ended) leave the seats part-empty at the tail of each round, while the next round's requests
waited up to 8.6 s; running ÷ seats averaged 0.83 and its mean wait was washed out, so a rule on
them never fired. Running + waiting requests (the demand) stay above the seats through the round,
and the waits' 90th percentile over the window keeps the waits of the round's middle.

Each decision also goes to the app's :class:`~router.observability.autoscaler_record.AutoscalerRecord` (a
small Ray actor), from which the ingress's ``/metrics`` exports it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Iterable

from router.observability.autoscaler_record import REASONS  # every reason a decision may give

__all__ = ["REASONS", "WAIT_QUANTILE", "CarpoolAutoscalingPolicy", "Decision", "Load", "decide", "high_quantile"]

WAIT_QUANTILE = 0.9
"""The quantile of a replica's head-of-queue wait samples over the look-back window that the policy
takes as its queue wait: high enough that waits in part of the window count (a mean is washed out
by the quiet tail of a round), low enough that one sample of a short burst does not (with 15
samples, the second highest)."""


def high_quantile(values: Iterable[float], q: float = WAIT_QUANTILE) -> float:
    """The ``q`` quantile of ``values`` by nearest rank (the ⌈q·n⌉-th smallest; 0.0 when empty)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else 0.0


def _finite(value: Any) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class Load:
    """What the replicas and the handles report, over the look-back window.

    Attributes:
        replicas: replicas that reported.
        running: requests holding a seat, summed over those replicas (window average).
        seats: seats (``max_num_seqs``), summed.
        waiting: requests waiting for a seat in the replicas' engines, summed (window average).
        queue_wait_s: seconds; per replica the :data:`WAIT_QUANTILE` quantile of its head-of-queue
            wait samples over the window (the window average where Serve gives no samples), the
            worst replica's.
        kv_cache_usage: the fraction of KV blocks in use, the replicas' mean (0 to 1): a new
            replica lowers it by taking new requests, where one replica's own use would stay
            high until its long requests end.
        ongoing: requests Serve counts as running or queued for the deployment (its own metric).
        queued: requests queued in the handles' routers, not yet sent to a replica (window
            average; Serve's ``total_queued_requests``): none while a replica takes requests,
            all of them at zero replicas or with every replica at ``max_ongoing_requests``.
    """

    replicas: int
    running: float
    seats: float
    waiting: float
    queue_wait_s: float
    kv_cache_usage: float
    ongoing: float
    queued: float = 0.0

    @property
    def seat_utilization(self) -> float:
        """Running requests / seats (0 with no seats)."""
        return self.running / self.seats if self.seats else 0.0

    @property
    def demand(self) -> float:
        """Requests that want a seat: running + waiting + queued at the handles."""
        return self.running + self.waiting + self.queued

    @classmethod
    def from_metrics(
        cls, metrics: dict[str, dict[Any, float]] | None, ongoing: float, raw: dict[str, dict[Any, list]] | None = None,
        queued: float | None = 0.0, since: float | None = None,
    ) -> "Load":
        """From Serve's context.

        Args:
            metrics: ``ctx.aggregated_metrics`` (metric name → replica → window average).
            ongoing: ``ctx.total_num_requests``.
            raw: ``ctx.raw_metrics`` (metric name → replica → the window's samples, objects with
                ``timestamp`` (s, ``time.time()``) and ``value``), for the wait's quantile.
            queued: ``ctx.total_queued_requests`` (None: 0).
            since: samples of ``raw`` older than this (s, ``time.time()``) are left out.
        Non-finite values are skipped, as if not reported.
        """
        metrics, raw = metrics or {}, raw or {}

        def per_replica(name: str) -> dict[Any, float]:
            return {r: f for r, v in (metrics.get(name) or {}).items() if (f := _finite(v)) is not None}

        def wait_of(replica: Any, average: float) -> float:
            samples = [
                f for s in (raw.get("queue_wait_s") or {}).get(replica) or ()
                if (since is None or s.timestamp >= since) and (f := _finite(s.value)) is not None
            ]
            return high_quantile(samples) if samples else average

        slots = per_replica("num_slots")
        waits = per_replica("queue_wait_s")
        return cls(
            replicas=len(slots),
            running=sum(per_replica("num_running").values()),
            seats=sum(slots.values()),
            waiting=sum(per_replica("num_waiting").values()),
            queue_wait_s=max((wait_of(r, w) for r, w in waits.items()), default=0.0),
            kv_cache_usage=_mean(per_replica("kv_cache_usage").values()),
            ongoing=float(ongoing or 0.0),
            queued=max(0.0, _finite(queued) or 0.0),
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
        load: the replicas' and handles' reports (:class:`Load`).
        current: replicas running now; ``target``: the count Serve is moving to.
        low, high: the bounds (``min_replicas``, ``max_replicas``, as Serve adjusts them).
        settings: ``AutoscalingSettings.carpool_kwargs()`` (utilizations 0-1, times in seconds).
        state: the previous decision's ``state`` (``{}`` at first).
        now: seconds (``time.time()``).
    Returns:
        the :class:`Decision`; its ``state`` holds ``up_since``/``down_since`` (when the current
        need began) and ``changed_at`` (the last change of target).
    Raises:
        KeyError: a setting of ``carpool_kwargs()`` missing from ``settings``.

    With D = ``load.demand`` (running + waiting + queued at the handles, window averages), S the
    seats of the replicas that reported, s = S / replicas, W = ``load.queue_wait_s`` (the
    window's 90th percentile) and u↑, u↓, w the target and downscale utilizations and the
    target wait, the rules, in order: no replica reported yet → hold; a change less than
    ``cooldown_s`` ago → hold; **up-pressure**: the seats do not serve the demand within the
    wait target (D ≥ u↑·S and W ≥ w), or KV ≥ ``target_kv_cache_usage`` → after
    ``upscale_delay_s`` of it without a break, and not while a replica is still starting, to
    max(target + 1, ⌈D / (u↑·s)⌉); **room to shrink**: ⌈D / (u↓·s)⌉ < target with W < w and no
    KV pressure (or, with ``min_replicas`` 0, no request at all) → after ``downscale_delay_s``,
    to that count (to 0 only from 1, as Serve allows it). Every count is bounded by ``low`` and
    ``high``; u↓ < u↑ leaves a band in which a steady load changes nothing.
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
    demand, waits = load.demand, load.queue_wait_s >= settings["target_queue_wait_s"]
    short = demand >= load.seats * settings["target_seat_utilization"] and waits
    kv_full = load.kv_cache_usage >= settings["target_kv_cache_usage"]
    needed_up = math.ceil(demand / (per_replica * settings["target_seat_utilization"]) - 1e-9)
    fits_on = max(1, math.ceil(demand / (per_replica * settings["downscale_seat_utilization"]) - 1e-9))
    idle = demand == 0 and load.ongoing == 0
    quiet = not waits and not kv_full
    want_up = (short or kv_full) and target < high
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
        return change(max(target + 1, needed_up), "seats_full_and_waiting" if short else "kv_cache_full")
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
        look_back = getattr(ctx.config, "look_back_period_s", None)
        load = Load.from_metrics(
            ctx.aggregated_metrics, ctx.total_num_requests, raw=ctx.raw_metrics,
            queued=ctx.total_queued_requests, since=None if look_back is None else now - look_back,
        )
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
            from router.observability.autoscaler_record import record_actor

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
                "demand": load.demand,
                "reason": decision.reason,
                "direction": ("up" if decision.target > ctx.target_num_replicas else "down") if changed else None,
                "time": now,
            })
            self._last_sent, self._last_sent_at = key, now
        except Exception:  # the record is for people; scaling goes on without it (the handle is kept:
            pass  # it owns the actor, which dropping it would end)
