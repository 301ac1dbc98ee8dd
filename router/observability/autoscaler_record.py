"""The autoscaling policy's last decision, where the ingress's ``/metrics`` can read it.

The Carpool policy (``cluster/autoscaling/policy.py``) runs inside Ray Serve's controller, which
has no HTTP endpoint of ours. Each decision (when it changes, and once a second) goes to one
small named Ray actor per application, :class:`AutoscalerRecord` (0 CPUs, in namespace
:data:`NAMESPACE`); the ingress asks it for its series at each scrape (:func:`exposition`).

Series (Prometheus text; ``application`` label: the Serve app's name):

* ``carpool:autoscaler_target_replicas``, ``carpool:autoscaler_current_replicas``,
  ``carpool:autoscaler_min_replicas``, ``carpool:autoscaler_max_replicas`` (gauges, replicas);
* the policy's inputs over its look-back window: averages ``carpool:autoscaler_seat_utilization``
  (0-1), ``carpool:autoscaler_kv_cache_usage`` (the replicas' mean, 0-1),
  ``carpool:autoscaler_requests_waiting``, ``carpool:autoscaler_demand`` (requests running,
  waiting or queued at the handles); ``carpool:autoscaler_queue_wait_seconds``, the 90th
  percentile of the head-of-queue wait samples, the worst replica's;
* ``carpool:autoscaler_last_decision{reason}``: 1 for the reason of the last decision, 0 for the
  others (every reason of :data:`REASONS` is present); most decisions hold the target (a change
  is followed by ``cooldown``), so ``carpool:autoscaler_last_change{reason}`` keeps the reason of
  the last change (:data:`CHANGE_REASONS`; all 0 before the first);
* ``carpool:autoscaler_decisions_total{direction}``: changes of the target, ``up`` or ``down``.
"""

from __future__ import annotations

import asyncio
from typing import Any

NAMESPACE = "carpool"
GAUGES = {
    "target_replicas": ("autoscaler_target_replicas", "Replicas the autoscaling policy targets."),
    "current_replicas": ("autoscaler_current_replicas", "Replicas running when the policy last decided."),
    "min_replicas": ("autoscaler_min_replicas", "The policy's lower bound (min_replicas)."),
    "max_replicas": ("autoscaler_max_replicas", "The policy's upper bound (max_replicas)."),
    "seat_utilization": ("autoscaler_seat_utilization", "Running requests / seats over the look-back window (policy input)."),
    "queue_wait_s": ("autoscaler_queue_wait_seconds", "Head-of-queue wait over the look-back window, 90th percentile of its samples, worst replica (policy input)."),
    "kv_cache_usage": ("autoscaler_kv_cache_usage", "The replicas' mean KV-block use, look-back average (policy input)."),
    "num_waiting": ("autoscaler_requests_waiting", "Requests waiting for a seat, look-back average (policy input)."),
    "demand": ("autoscaler_demand", "Requests running, waiting or queued at the handles, look-back average (policy input)."),
}
REASONS = (
    "seats_full_and_waiting", "kv_cache_full", "seats_underused", "idle",
    "within_targets", "up_delay", "down_delay", "cooldown", "replicas_starting", "no_reports",
)
"""Every reason a decision of the policy may give (``cluster/autoscaling/policy.py``'s ``decide``)."""
CHANGE_REASONS = REASONS[:4]
"""The reasons of a change of the target (the others hold it)."""


def actor_name(app_name: str | None) -> str:
    return f"autoscaler-record:{app_name or 'default'}"


class AutoscalerRecord:
    """Holds the last decision and counts changes (Ray actor body; :func:`record_actor` makes it)."""

    def __init__(self, app_name: str) -> None:
        self.app_name = app_name
        self.last: dict[str, Any] | None = None
        self.last_change: str | None = None  # the reason of the last change of the target
        self.decisions = {"up": 0, "down": 0}

    def update(self, decision: dict[str, Any]) -> None:
        """One decision (keys: :data:`GAUGES`' plus ``reason``, ``direction`` (``up``, ``down`` or
        None when the target did not change) and ``time``)."""
        if decision.get("direction") in self.decisions:
            self.decisions[decision["direction"]] += 1
            self.last_change = decision.get("reason")
        self.last = decision

    def snapshot(self) -> dict[str, Any]:
        """``{"last": the last decision or None, "last_change": its reason or None,
        "decisions": {"up": n, "down": n}}``."""
        return {"last": self.last, "last_change": self.last_change, "decisions": dict(self.decisions)}

    def exposition(self) -> str:
        """The series above in the Prometheus text format ("" before the first decision)."""
        if self.last is None:
            return ""
        from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics, generate_latest

        disable_created_metrics()  # this actor's own process: no *_created series beside the counter

        registry = CollectorRegistry()
        labels = {"application": self.app_name}
        for key, (name, doc) in GAUGES.items():
            Gauge(f"carpool:{name}", doc, list(labels), registry=registry).labels(**labels).set(float(self.last.get(key) or 0))
        reason = Gauge(
            "carpool:autoscaler_last_decision", "1 for the reason of the policy's last decision.", [*labels, "reason"],
            registry=registry,
        )
        for r in REASONS:
            reason.labels(**labels, reason=r).set(1.0 if self.last.get("reason") == r else 0.0)
        change = Gauge(
            "carpool:autoscaler_last_change", "1 for the reason of the policy's last change of the target.",
            [*labels, "reason"], registry=registry,
        )
        for r in CHANGE_REASONS:
            change.labels(**labels, reason=r).set(1.0 if self.last_change == r else 0.0)
        counter = Counter(
            "carpool:autoscaler_decisions", "Changes of the target replica count, by direction.", [*labels, "direction"],
            registry=registry,
        )
        for direction, count in self.decisions.items():
            counter.labels(**labels, direction=direction).inc(count)
        return generate_latest(registry).decode()


def record_actor(app_name: str | None, create: bool = False):
    """The app's record actor: made if ``create`` (0 CPUs, owned by the caller: Serve's
    controller), else looked up. Raises ``ValueError`` when it does not exist and not ``create``."""
    import ray

    name = actor_name(app_name)
    if create:
        return ray.remote(AutoscalerRecord).options(
            name=name, namespace=NAMESPACE, get_if_exists=True, num_cpus=0, max_restarts=-1,
        ).remote(app_name or "default")
    return ray.get_actor(name, namespace=NAMESPACE)


async def exposition(app_name: str | None, timeout_s: float = 2.0) -> str:
    """The app's autoscaler series, or "" when it has no record (not autoscaled by the Carpool
    policy, or no decision yet) or the record does not answer within ``timeout_s``."""
    try:
        actor = await asyncio.to_thread(record_actor, app_name)
        return await asyncio.wait_for(actor.exposition.remote(), timeout_s)
    except Exception:
        return ""
