"""Admission by latency target: predict a new request's time to first token on this replica from
its queue and its measured step cost (:func:`predict_ttft_s`), so that a request that asked to be
shed rather than served late (``LatencyTargets.shed``) is refused at once
(``LLMReplica.generate`` raises :class:`~replica.protocol.errors.LatencyTargetError`: HTTP 429
with ``Retry-After``).

The prediction, in engine steps times the step's measured cost (``EngineStats.step_time_s``):

* seats: each running request frees its seat after at most its steps left (its prompt still to
  prefill, in steps of the token budget, plus ``max_tokens`` less its output so far); a free seat
  is free now;
* the waiting requests that run before the new one (all of them under ``fcfs``; those of priority
  ``<=`` its own under ``priority``), in queue order, each take the seat that frees first and hold
  it for their own steps at most (a list scheduling of the queue on ``max_num_seqs`` machines);
* the new request takes the next free seat, then prefills its prompt in steps of what the token
  budget leaves after one decode token per running request (running requests are served first),
  and its first token comes out of its last prefill step.

``max_tokens`` is an upper bound on a request's length (it may stop earlier), so the prediction
errs late: a request is shed a little more often than strictly needed, and one that is admitted
rarely misses. Preemption by a request of higher priority that arrives later is not foreseen.
Torch-free.
"""

from __future__ import annotations

import heapq
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from replica.engine.stats import EngineStats

STEP_COST_WEIGHT = 0.1
"""Weight of the newest step in the exponentially weighted mean of the step cost
(``EngineStats.step_time_s``): about the last 10 steps count."""

MAX_LISTED_WAITING = 256
"""The waiting requests whose lengths the stats list (``EngineStats.waiting_steps``); with more
waiting than that, any prediction is infinite (a request behind 256 others is late)."""


def steps_left(num_to_prefill: int, max_tokens: int, num_output_tokens: int, token_budget: int) -> int:
    """Steps a request needs at most to finish: the known tokens it has still to compute before
    its next token (``num_tokens - 1 - num_computed_tokens``: its prompt, or prompt and output
    again after a preemption) in steps of ``token_budget`` tokens, then one step per output token
    it may still generate."""
    prefill = -(-max(0, num_to_prefill) // max(1, token_budget))
    return prefill + max(0, max_tokens - num_output_tokens)


def update_step_cost(mean_s: float | None, step_s: float) -> float:
    """The step cost's exponentially weighted mean after a step of ``step_s`` seconds
    (:data:`STEP_COST_WEIGHT`); the first step sets it."""
    return step_s if mean_s is None else mean_s + STEP_COST_WEIGHT * (step_s - mean_s)


def predict_ttft_s(stats: EngineStats, num_prompt_tokens: int, priority: int = 0) -> float | None:
    """Predicted seconds from now to the first token of a request of ``num_prompt_tokens`` prompt
    tokens and ``priority`` added to the engine whose snapshot is ``stats`` (the rules in the
    module docstring); ``None`` before the engine has timed a step (nothing to predict from);
    ``math.inf`` when more requests wait than ``stats`` lists."""
    if stats.step_time_s is None:
        return None
    if stats.num_waiting > len(stats.waiting_steps):
        return math.inf
    seats = [0] * max(0, stats.num_slots - stats.num_running) + list(stats.seat_steps)
    if not seats:
        return math.inf
    heapq.heapify(seats)
    for waiting_priority, steps in stats.waiting_steps:
        if waiting_priority <= priority:  # runs before the new request (all of them under fcfs)
            heapq.heapreplace(seats, seats[0] + steps)
    budget = max(1, stats.token_budget - min(stats.num_running, stats.token_budget - 1))
    prefill_steps = -(-max(1, num_prompt_tokens) // budget)
    return (seats[0] + prefill_steps) * stats.step_time_s
