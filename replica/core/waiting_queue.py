"""The order of the waiting queue (``EngineConfig.scheduling_policy``): ``"fcfs"`` or ``"priority"``,
and, under ``"priority"``, which running request a waiting one of higher priority preempts.

Plain Python, no torch. vLLM's names and semantics: a request's ``priority`` is an int, **lower
runs first**, 0 by default; under ``"fcfs"`` only 0 is accepted (vLLM: "Got priority ... but
Priority scheduling is not enabled"; :func:`~replica.protocol.request_checks.check_priority`).

Under ``"priority"`` (vLLM's ``SchedulingPolicy.PRIORITY``):

* the waiting queue is ordered by ``(priority, arrival_time)`` (:class:`PriorityQueue`; vLLM v1's
  ``PriorityRequestQueue``), equal keys in the order they were queued. A preempted request goes
  back to its own ``(priority, arrival)`` place, not to the front, so it never overtakes a waiting
  request of higher priority, and one of lower priority never overtakes it;
* running requests are kept in the same order (:func:`seat`), so the scheduler serves them in
  priority order and its victim when blocks run out (the last running request that holds blocks)
  is the one of lowest priority, newest first: vLLM v1's ``max(running, key=(priority, arrival))``;
* when the head of the waiting queue cannot be admitted (no free seat, or too few free KV blocks
  for its first chunk), running requests of strictly lower priority (a larger number) are
  preempted by recompute, lowest first, until it fits (:func:`priority_victim`; vLLM V0's
  ``Scheduler._schedule_priority_preemption``). Unlike V0, a request of *equal* priority is never
  preempted for a later one, so equal priorities keep FCFS and two requests never preempt each
  other in turn. A victim's blocks stay in the prefix cache, so its recompute often finds them.

No livelock: a request is only preempted for one of strictly higher priority, and it then waits
behind it. The head it made room for is admitted in the same step (with any other waiting request
of a priority above every victim's), so it waits for no extra step; a step that preempts a request
for KV blocks admits nothing, as in vLLM v1. Not preempted for: the token budget (running
requests are served first, as in vLLM), and a head that waits for a LoRA slot.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import Any, Literal

from replica.core.lora_limit import LoRAAdmission
from replica.core.prefix_lookup import first_chunk_start
from replica.core.request import Request

SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES: tuple[str, ...] = ("fcfs", "priority")


def priority_key(request: Request) -> tuple[int, float]:
    """``(priority, arrival_time)``: smaller runs first (vLLM's ``Request.__lt__``, less its id tie-break)."""
    return request.priority, request.arrival_time


class PriorityQueue:
    """Waiting requests in ``(priority, arrival_time)`` order, equal keys first queued first.

    The operations the scheduler uses on the ``"fcfs"`` policy's ``deque``: ``append`` and
    ``appendleft`` (both insert at the request's place: O(log n) search, O(n) insert),
    ``popleft``, ``remove``, indexing, ``del``, ``len`` and iteration (in order).
    """

    def __init__(self) -> None:
        self._items: list[Request] = []

    def append(self, request: Request) -> None:
        bisect.insort_right(self._items, request, key=priority_key)

    appendleft = append  # a preempted request goes back to its own place, not to the front

    def popleft(self) -> Request:
        return self._items.pop(0)

    def remove(self, request: Request) -> None:
        """Raises ``ValueError`` when ``request`` is not queued."""
        self._items.remove(request)

    def __getitem__(self, index: int) -> Request:
        return self._items[index]

    def __delitem__(self, index: int) -> None:
        del self._items[index]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)

    def __repr__(self) -> str:
        return f"PriorityQueue({[(r.request_id, r.priority) for r in self._items]})"


def seat(running: list[Request], request: Request, policy: str) -> None:
    """Add ``request`` to the ``running`` list: last under ``"fcfs"`` (admission order), at its
    ``(priority, arrival)`` place under ``"priority"``."""
    if policy == "priority":
        bisect.insort_right(running, request, key=priority_key)
    else:
        running.append(request)


def priority_victim(scheduler: Any) -> Request | None:
    """The running request to preempt now so that the head of ``scheduler.waiting`` (the highest
    priority waiting) can be admitted, or None: it fits already, it waits for a LoRA slot, or no
    running request has a strictly lower priority (a larger number) than it.

    ``scheduler``: a :class:`~replica.core.scheduler.Scheduler` (not imported: it imports this
    module). Call it at the start of a step (before any row is scheduled) until it returns None,
    preempting each request it returns; ``scheduler.running`` must be in :func:`seat`'s priority
    order (its last unfinished request is the lowest priority, newest).
    """
    waiting, running = scheduler.waiting, scheduler.running
    if not waiting or not running:
        return None
    head = waiting[0]
    victim = next((r for r in reversed(running) if not r.is_finished), None)
    if victim is None or victim.priority <= head.priority:  # cheap first: nothing of lower priority runs
        return None
    if LoRAAdmission(running, scheduler.max_loras).blocked(head) or _fits(scheduler, head):
        return None
    return victim


def _fits(scheduler: Any, head: Request) -> bool:
    """Whether ``head`` could be admitted now: a free seat (counting those of the requests whose
    last token the step in flight computes, which async scheduling frees this step) and the KV
    blocks of its first chunk (a full token budget's, after its cached prefix)."""
    ending = sum(
        1 for r in scheduler.running
        if not r.is_finished and r.num_computed_tokens >= scheduler._known_or_pending(r)
    )
    if len(scheduler.running) - ending >= scheduler.max_num_seqs:
        return False
    cached, start = first_chunk_start(scheduler.block_manager, head)
    target = start + min(head.num_tokens - start, scheduler.max_num_batched_tokens)
    return scheduler.block_manager.can_allocate(head.request_id, target, cached or ())


def priority_counts(requests: Iterator[Request] | list[Request], limit: int = 16) -> tuple[tuple[int, int], ...]:
    """``((priority, requests), ...)`` over ``requests``, lowest priority value first, at most
    ``limit`` pairs: the requests of the priorities past the ``limit - 1`` lowest are counted in
    the last pair, under the lowest of those priorities (so a reader that counts the requests of
    priority ``<= p`` never counts too few). What a replica reports for priority-aware routing."""
    counts: dict[int, int] = {}
    for request in requests:
        counts[request.priority] = counts.get(request.priority, 0) + 1
    pairs = sorted(counts.items())
    if len(pairs) > limit:
        pairs = [*pairs[: limit - 1], (pairs[limit - 1][0], sum(n for _, n in pairs[limit - 1:]))]
    return tuple(pairs)
