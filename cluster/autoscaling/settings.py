"""Autoscaling settings of the replica deployment (``autoscaling:`` in a config file, ``--autoscale``).

Two policies, both run by Ray Serve's controller:

* ``carpool`` (the default): :class:`~cluster.autoscaling.policy.CarpoolAutoscalingPolicy`, on
  what an LLM replica runs short of (seats taken, how long the head of its queue has waited for
  a seat, KV blocks in use), which each replica reports to Serve
  (``LLMReplica.record_autoscaling_stats``);
* ``ongoing_requests``: Serve's own policy, on requests running or queued per replica
  (``target_ongoing_requests``).

Every setting is checked at start, with the setting's name in the message (pydantic, then
Serve's own ``AutoscalingConfig`` validation on what is passed to Serve).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

POLICY_FUNCTION = "cluster.autoscaling.policy:CarpoolAutoscalingPolicy"
"""Import path of the Carpool policy, as Serve's ``AutoscalingPolicy.policy_function`` takes it."""

CARPOOL_ONLY = (
    "target_seat_utilization", "target_queue_wait_s", "target_kv_cache_usage",
    "downscale_seat_utilization", "cooldown_s",
)
"""Settings of the ``carpool`` policy; refused with ``policy: ongoing_requests``."""
ONGOING_ONLY = ("target_ongoing_requests",)
"""Settings of Serve's ``ongoing_requests`` policy; refused with ``policy: carpool``."""


class AutoscalingSettings(BaseModel):
    """Autoscale ``LLMReplica`` between ``min_replicas`` and ``max_replicas``.

    ``carpool`` policy, per decision (Serve's control loop, every 0.1 s), on the replicas' reports
    over ``look_back_period_s`` (demand = running + waiting requests, summed over the replicas,
    plus those queued in Serve's handles, window averages; queue wait = the 90th percentile of a
    replica's head-of-queue wait samples in the window, the worst replica's, seconds; KV use =
    the replicas' mean fraction of KV blocks in use); rule and source in
    ``cluster/autoscaling/policy.py``'s ``decide``:

    * **up** when the seats do not serve the demand within the wait target (demand ≥
      ``target_seat_utilization`` × seats and queue wait ≥ ``target_queue_wait_s``), or the KV
      pool is nearly full (≥ ``target_kv_cache_usage``), continuously for ``upscale_delay_s``: to
      as many replicas as the demand needs at ``target_seat_utilization``;
    * **down** when the demand would fit on fewer replicas at ``downscale_seat_utilization`` or
      less, with no wait, continuously for ``downscale_delay_s``; to 0 only with
      ``min_replicas: 0``, after no request for that long;
    * **hold** otherwise, while a replica starts, and for ``cooldown_s`` after each change.

    ``look_back_period_s``, the delays and ``metrics_interval_s`` are in seconds.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    policy: Literal["carpool", "ongoing_requests"] = Field(
        "carpool",
        description="carpool: seats, queue wait and KV use; ongoing_requests: Serve's policy on requests per replica.",
    )
    min_replicas: int = Field(1, ge=0, description="Fewest replicas (0 allows scaling to zero).")
    max_replicas: int = Field(..., ge=1, description="Most replicas (on GPUs: at most the GPUs the cluster can have).")
    initial_replicas: int | None = Field(None, ge=0, description="Replicas at deployment; default min_replicas.")
    look_back_period_s: float = Field(30.0, gt=0, description="Window the replicas' reports are averaged over (s).")
    metrics_interval_s: float = Field(2.0, gt=0, description="How often each replica reports to Serve's controller (s).")
    upscale_delay_s: float | None = Field(
        None, ge=0, description="How long the need for more replicas must last before adding them (default 15 s; ongoing_requests: Serve's 30 s)."
    )
    downscale_delay_s: float | None = Field(
        None, ge=0, description="How long the room for fewer replicas must last before removing one (default 120 s; ongoing_requests: Serve's 600 s)."
    )
    drain_timeout_s: float = Field(
        300.0, gt=0,
        description="How long a replica being removed may finish the requests it runs (it takes no new ones) before Serve stops it.",
    )
    # the carpool policy
    target_seat_utilization: float | None = Field(
        None, gt=0, le=1, description="Demand (running + waiting requests) per seat (0-1] at or above which, with queue waits, the policy adds replicas (default 0.9)."
    )
    target_queue_wait_s: float | None = Field(
        None, gt=0, description="Head-of-queue wait (s; the window's 90th percentile) at or above which, with the demand over the seats, the policy adds replicas (default 1.0)."
    )
    target_kv_cache_usage: float | None = Field(
        None, gt=0, le=1, description="KV blocks in use (0-1] at or above which the policy adds replicas (default 0.95)."
    )
    downscale_seat_utilization: float | None = Field(
        None, gt=0, lt=1, description="Demand per seat at or below which one replica fewer would still serve it (default 0.5)."
    )
    cooldown_s: float | None = Field(None, ge=0, description="Decisions held after each change (s; default 60).")
    # Serve's ongoing_requests policy
    target_ongoing_requests: float | None = Field(
        None, gt=0, description="ongoing_requests: requests running or waiting per replica that Serve aims for (default 32)."
    )

    @model_validator(mode="after")
    def _check(self) -> "AutoscalingSettings":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) is above max_replicas ({self.max_replicas})")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError(
                f"initial_replicas ({self.initial_replicas}) must lie between min_replicas ({self.min_replicas}) "
                f"and max_replicas ({self.max_replicas})"
            )
        if self.look_back_period_s <= self.metrics_interval_s:
            raise ValueError(
                f"look_back_period_s ({self.look_back_period_s:g}) must be longer than metrics_interval_s "
                f"({self.metrics_interval_s:g}): the window must hold several reports"
            )
        foreign = ONGOING_ONLY if self.policy == "carpool" else CARPOOL_ONLY
        given = [name for name in foreign if getattr(self, name) is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: not a setting of policy {self.policy!r}")
        if self.policy == "carpool":
            up, down = self.carpool_kwargs()["target_seat_utilization"], self.carpool_kwargs()["downscale_seat_utilization"]
            if down >= up:
                raise ValueError(
                    f"downscale_seat_utilization ({down:g}) must be below target_seat_utilization ({up:g}), "
                    "or every decision would be undone by the next"
                )
        from ray.serve.config import AutoscalingConfig  # Serve's own checks on what it gets

        AutoscalingConfig(**self.serve_options())
        return self

    def carpool_kwargs(self) -> dict[str, float]:
        """The Carpool policy's settings (``policy_kwargs``), defaults filled in."""
        def pick(value: float | None, default: float) -> float:
            return default if value is None else value

        return {
            "target_seat_utilization": pick(self.target_seat_utilization, 0.9),
            "target_queue_wait_s": pick(self.target_queue_wait_s, 1.0),
            "target_kv_cache_usage": pick(self.target_kv_cache_usage, 0.95),
            "downscale_seat_utilization": pick(self.downscale_seat_utilization, 0.5),
            "upscale_delay_s": pick(self.upscale_delay_s, 15.0),
            "downscale_delay_s": pick(self.downscale_delay_s, 120.0),
            "cooldown_s": pick(self.cooldown_s, 60.0),
        }

    def serve_options(self) -> dict:
        """The deployment's ``autoscaling_config`` for Serve.

        ``carpool``: the policy and its settings (``policy_kwargs``); Serve's own delays are 0,
        because the policy applies its delays and cooldown itself (so what it reports is what
        happens). ``ongoing_requests``: Serve's fields as given (unset ones left to Serve).
        """
        common = {
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "look_back_period_s": self.look_back_period_s,
            "metrics_interval_s": self.metrics_interval_s,
        }
        if self.initial_replicas is not None:
            common["initial_replicas"] = self.initial_replicas
        if self.policy == "ongoing_requests":
            serve = {
                "target_ongoing_requests": 32 if self.target_ongoing_requests is None else self.target_ongoing_requests,
                "upscale_delay_s": self.upscale_delay_s,
                "downscale_delay_s": self.downscale_delay_s,
            }
            return {**common, **{k: v for k, v in serve.items() if v is not None}}
        return {
            **common,
            "upscale_delay_s": 0.0,
            "downscale_delay_s": 0.0,
            "policy": {"policy_function": POLICY_FUNCTION, "policy_kwargs": self.carpool_kwargs()},
        }


def parse_autoscale(text: str) -> dict[str, int]:
    """``--autoscale MIN:MAX`` (e.g. ``1:4``, ``0:2``) as ``{"min_replicas", "max_replicas"}``.

    Raises ``ValueError`` naming the flag when ``text`` is not two non-negative integers.
    """
    low, sep, high = text.partition(":")
    if not sep or not low.strip().isdigit() or not high.strip().isdigit():
        raise ValueError(f"--autoscale takes MIN:MAX replicas, e.g. 1:4, got {text!r}")
    return {"min_replicas": int(low), "max_replicas": int(high)}
