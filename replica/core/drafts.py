"""Speculative decoding's share of scheduling: room for a decode row's drafts, and the rollback of
the rejected ones (plain Python, no torch).

A decode row verifies ``k`` drafts by computing ``1 + k`` tokens: its last known token and the
drafts after it (``ScheduledRequest.spec_token_ids``). :func:`reserve_drafts` grows the row after
the step is scheduled, from what the step leaves: its token budget, free blocks (it never preempts
for a draft), ``max_model_len`` and ``max_tokens``. After the step, :func:`roll_back` takes the
rejected drafts' positions off ``num_computed_tokens`` and gives back the blocks that held only
them. Drafts are never registered in the prefix cache: registration covers known tokens only
(:meth:`replica.core.scheduler.Scheduler._allocate`), and a draft becomes known only once accepted.
"""

from __future__ import annotations

from replica.core.request import Request
from replica.core.scheduler_output import ScheduledRequest, SchedulerOutput


def draft_room(scheduler, out: SchedulerOutput, row: ScheduledRequest, max_drafts: int) -> int:
    """How many drafts (≤ ``max_drafts``) ``row``, a decode row of ``out``, may verify: bounded by
    the step's token budget left, the request's ``max_tokens`` and ``max_model_len`` (all ``1 + k``
    tokens a verified row may emit must fit) and the free blocks. 0 for a row that is not a plain
    decode (a prefill chunk, a padding row, a token from a step in flight)."""
    request = row.request
    if (
        row.is_padding or row.from_previous or not row.samples or row.num_new_tokens != 1
        or row.start != request.num_tokens - 1 or request.num_pending
    ):
        return 0
    room = min(
        max_drafts,
        scheduler.max_num_batched_tokens - out.num_batched_tokens,
        request.sampling_params.max_tokens - request.num_output_tokens - 1,
        scheduler.max_model_len - request.num_tokens - 1,
    )
    bm = scheduler.block_manager
    while room > 0 and not bm.can_allocate(request.request_id, request.num_tokens + room):
        room -= 1
    return max(room, 0)


def reserve_drafts(scheduler, out: SchedulerOutput, row: ScheduledRequest, num_drafts: int) -> int:
    """Grow decode row ``row`` of ``out`` by up to ``num_drafts`` draft positions (see
    :func:`draft_room`) and allocate their blocks; returns how many. The caller then fills
    ``row.spec_token_ids`` with that many drafts at most, and sets ``row.num_new_tokens`` to ``1 +``
    their count (:func:`set_drafts`)."""
    num = min(num_drafts, draft_room(scheduler, out, row, num_drafts))
    if num > 0:
        request = row.request
        scheduler.block_manager.allocate(request.request_id, request.num_tokens + num)
        request.block_ids = scheduler.block_manager.block_table(request.request_id)
        row.num_new_tokens = 1 + num
    return max(num, 0)


def set_drafts(row: ScheduledRequest, drafts: list[int]) -> None:
    """Put ``drafts`` (at most the reserved count) in ``row``; the row computes ``1 + len(drafts)``
    tokens (blocks reserved for more are given back after the step, by :func:`roll_back`)."""
    if len(drafts) > row.num_new_tokens - 1:
        raise ValueError(f"{len(drafts)} drafts for a row with room for {row.num_new_tokens - 1}")
    row.spec_token_ids = list(drafts)
    row.num_new_tokens = 1 + len(drafts)


def roll_back(scheduler, request: Request, row: ScheduledRequest, num_accepted: int) -> None:
    """After the step that verified ``row``'s drafts, before its tokens are appended: only the
    first ``num_accepted`` drafts' K/V counts as computed (the position after them holds a
    rejected draft's K/V, never the token that replaces it), and the blocks past what the request's
    ``1 + num_accepted`` new tokens need are given back."""
    request.num_computed_tokens -= len(row.spec_token_ids) - num_accepted
    if scheduler.block_manager.truncate(request.request_id, request.num_tokens + 1 + num_accepted):
        request.block_ids = scheduler.block_manager.block_table(request.request_id)
