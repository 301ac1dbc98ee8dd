"""What proposes drafts: the interface every proposer implements (prompt lookup, a draft model; an
EAGLE or MTP head would be one more), so that the scheduler and the verification never change."""

from __future__ import annotations

from typing import Protocol

from replica.core.request import Request
from replica.core.scheduler_output import ScheduledRequest


class Proposer(Protocol):
    """Proposes up to ``k`` drafts per decode row of a step, after the step is scheduled and before
    its forward (:class:`~replica.spec_decode.speculator.Speculator` calls it)."""

    def available(self, request: Request, max_drafts: int) -> int:
        """How many drafts (≤ ``max_drafts``) it can propose for ``request``'s next token now; cheap
        (the planner asks before choosing). 0: none (prompt lookup found no match)."""
        ...

    def propose(self, rows: list[ScheduledRequest], counts: list[int]) -> list[list[int]]:
        """Drafts for each of ``rows`` (decode rows at their request's last known token, with room
        for ``counts[i]`` drafts: their blocks are allocated), at most ``counts[i]`` each."""
        ...

    @property
    def seconds_per_position(self) -> float:
        """Seconds one more draft position costs the step whatever the rows (a draft model's
        forward; 0 for prompt lookup): part of the planner's step cost."""
        ...

    def forget(self, request_id: str) -> None:
        """The request left the running batch (finished, aborted or preempted)."""
        ...
