"""Admission by latency target: predict a new request's time to first token on this replica from
its queue and its measured step cost (:func:`predict_ttft_s`), so that a request that asked to be
shed rather than served late (``LatencyTargets.shed``) is refused at once
(``LLMReplica.generate`` raises :class:`~replica.protocol.errors.LatencyTargetError`: HTTP 429
with ``Retry-After``).

The prediction, in engine steps times the step's measured cost (``EngineStats.step_time_s``):

* seats: each running request frees its seat after at most its steps left (its tokens still to
  prefill, in steps of the token budget, the last of which samples a token, then one step per
  further token up to ``max_tokens``; :func:`steps_left`); a free seat is free now;
* the waiting requests that run before the new one (all of them under ``fcfs``; those of priority
  ``<=`` its own under ``priority``), in queue order, each take the seat that frees first and hold
  it for their own steps at most (a list scheduling of the queue on ``max_num_seqs`` machines);
* the new request waits for the step in flight, takes the next free seat, then prefills its
  prompt in steps of what the token budget leaves after one decode token per running request
  (running requests are served first), and its first token comes out of its last prefill step;
* it is shed when that exceeds :data:`TARGET_HEADROOM` of its target (:func:`would_miss`).

Requests the replica admitted but its engine has not queued yet count as waiting after the
listed ones (``unseen``), so that a burst is not predicted against the queue it found. An idle
engine never predicts (the request runs at once).

``max_tokens`` is an upper bound on a request's length (it may stop earlier), so the queue part
errs late; the step cost is a recent mean, and steps grow slower as the batch fills, which errs
early. Not foreseen: preemptions under the ``priority`` policy (a new request of higher priority
takes seats its prediction counts as held; one that arrives later delays it), and the static
batching baseline's seats, which free only when a whole batch ends.
Torch-free.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from replica.engine.stats import MAX_LISTED_WAITING, EngineStats, steps_left
from replica.protocol.errors import LatencyTargetError

if TYPE_CHECKING:
    from replica.protocol.envelope import RequestEnvelope

STEP_COST_WEIGHT = 0.1
"""Weight of the newest step in the exponentially weighted mean of the step cost
(``EngineStats.step_time_s``): about the last 10 steps count."""

TARGET_HEADROOM = 0.85
"""A request is shed when its predicted TTFT exceeds this fraction of its target: the rest is room
for what the prediction does not see (steps that slow down as the batch fills and as queued
prompts prefill, the ingress's own time before the replica). Its error on this CPU is measured
in docs/bench/latency-targets-cpu.md."""


def update_step_cost(mean_s: float | None, step_s: float) -> float:
    """The step cost's exponentially weighted mean after a step of ``step_s`` seconds
    (:data:`STEP_COST_WEIGHT`); the first step sets it."""
    return step_s if mean_s is None else mean_s + STEP_COST_WEIGHT * (step_s - mean_s)


def predict_ttft_s(
    stats: EngineStats, num_prompt_tokens: int, priority: int = 0, unseen: tuple[tuple[int, int], ...] = ()
) -> float | None:
    """Predicted seconds from now to the first token of a request of ``num_prompt_tokens`` prompt
    tokens and ``priority`` added to the engine whose snapshot is ``stats`` (the rules in the
    module docstring). ``unseen``: ``(priority, steps)`` of requests already admitted to this
    engine but not yet in its snapshot; they queue after the listed ones. ``None``: nothing to
    predict from (no step timed yet), or an idle engine (nothing running, waiting or unseen: the
    request is served as soon as it can be, and a stale step cost must not refuse it);
    ``math.inf`` when more requests wait than ``stats`` lists."""
    if stats.step_time_s is None or (stats.num_running == 0 and stats.num_waiting == 0 and not unseen):
        return None
    if stats.num_waiting > len(stats.waiting_steps):
        return math.inf
    seats = [0] * max(0, stats.num_slots - stats.num_running) + list(stats.seat_steps)
    if not seats:
        return math.inf
    heapq.heapify(seats)
    for waiting_priority, steps in (*stats.waiting_steps, *unseen):
        if waiting_priority <= priority:  # runs before the new request (all of them under fcfs)
            heapq.heapreplace(seats, seats[0] + steps)
    budget = max(1, stats.token_budget - min(stats.num_running, stats.token_budget - 1))
    prefill_steps = -(-max(1, num_prompt_tokens) // budget)
    return (1 + seats[0] + prefill_steps) * stats.step_time_s


def would_miss(predicted_s: float | None, target_s: float) -> bool:
    """Whether a request predicted to reach its first token in ``predicted_s`` (None: no
    prediction) is shed for a TTFT target of ``target_s``: the prediction exceeds
    :data:`TARGET_HEADROOM` of the target."""
    return predicted_s is not None and predicted_s > TARGET_HEADROOM * target_s


class Admission:
    """A replica's admission by latency target: it sheds the requests that ask to be and would be
    late (:meth:`admit`), and keeps the requests it admitted until they end (:meth:`release`), so
    that the ones its engine's snapshot does not hold yet still count in the queue.

    Args:
        stats: returns the engine's latest snapshot (``AsyncLLMEngine.stats``; any thread).
        on_shed: called once per shed request (the ``shed`` metric).
    """

    def __init__(self, stats: Callable[[], EngineStats], on_shed: Callable[[], None] = lambda: None) -> None:
        self._stats = stats
        self._on_shed = on_shed
        self._admitted: dict[str, tuple[int, int]] = {}  # request id -> (priority, steps at most), oldest first

    def admit(self, request: RequestEnvelope) -> None:
        """Admit ``request`` (a checked envelope), or refuse it: it asked to be shed
        (``LatencyTargets.shed``) and :func:`predict_ttft_s`, from the snapshot and the admitted
        requests the snapshot does not hold yet (the newest ones, beyond its running and waiting
        counts), says it would miss its TTFT target (:func:`would_miss`).

        Raises:
            LatencyTargetError: refused; nothing was recorded.
        """
        stats = self._stats()
        slo = request.slo
        if slo is not None and slo.shed and slo.ttft_s is not None:
            unseen = max(0, len(self._admitted) - stats.num_running - stats.num_waiting)
            queued = tuple(self._admitted.values())[len(self._admitted) - unseen :] if unseen else ()
            predicted = predict_ttft_s(stats, len(request.prompt_token_ids), request.priority, queued)
            if would_miss(predicted, slo.ttft_s):
                self._on_shed()
                raise LatencyTargetError(predicted, slo.ttft_s)
        steps = steps_left(len(request.prompt_token_ids), request.sampling_params.max_tokens, 0, stats.token_budget)
        self._admitted[request.request_id] = (request.priority, steps)

    def release(self, request_id: str) -> None:
        """The request has ended (or was refused); idempotent."""
        self._admitted.pop(request_id, None)
