"""What a scheduler step hands the model runner: the requests of the step and their token ranges.

Plain data, no torch (``replica.core.scheduler`` fills it, ``replica.worker.model_runner`` reads it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from replica.core.request import Request


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    The step computes tokens ``[start, start + num_new_tokens)`` of ``request`` (prompt then
    output). ``samples`` is true when the chunk reaches the last known token, so the step yields
    a new token for it. ``from_previous`` (async scheduling): the row's one input token is the one
    the step still in flight samples for this request; the model runner takes it from that step's
    device tensor.

    ``spec_token_ids`` (speculative decoding): drafted tokens past the request's known ones, which
    this row's chunk holds as input after its last known token. A decode row that verifies ``k``
    drafts starts at the last known token and computes ``1 + k`` tokens
    (:meth:`replica.core.scheduler.Scheduler.reserve_drafts`); a draft model's own rows hold the
    drafts it proposed so far.

    ``is_padding``, the static baseline only (:mod:`replica.core.static_batching`): the row of a
    finished batch member, computed as a padded static batch would. It recomputes the request's
    last token at the next position (one token, ``samples`` true) and its sample is thrown away.
    """

    request: Request
    start: int
    num_new_tokens: int
    samples: bool
    is_padding: bool = False
    from_previous: bool = False
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def num_verified_drafts(self) -> int:
        """Drafts this row verifies: its drafts when it starts at the request's last known token."""
        return len(self.spec_token_ids) if self.start == self.request.num_tokens - 1 else 0


@dataclass
class SchedulerOutput:
    """One step's schedule: ``scheduled`` rows in forward order, the requests ``preempted`` to
    make room (their blocks are free again), and ``newly_cached`` block ids registered in the
    prefix cache for this step to fill (dropped from the cache if the step fails)."""

    step: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    newly_cached: list[int] = field(default_factory=list)  # blocks registered for this step to fill
    # LoRA: the adapters of the running requests (the runner keeps them in their slots).
    active_loras: list = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
