"""What an engine reports about itself, as plain immutable data: :class:`EngineStats` (a snapshot
of its load: what the router, the metrics and the health check read), :class:`StepRecord` (one
step, for step observers such as the benchmarks) and :class:`EngineInfo` (its settings as they
took effect: dtype, device, KV blocks, async scheduling, CUDA graphs). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING

from replica.core.waiting_queue import priority_counts
from replica.spec_decode.stats import SpecDecodeStats

__all__ = ["EngineInfo", "EngineStats", "SpecDecodeStats", "StepRecord", "StepRow"]

if TYPE_CHECKING:
    from replica.core.block_manager import BlockManager
    from replica.core.scheduler import Scheduler
    from replica.core.scheduler_output import SchedulerOutput


MAX_LISTED_WAITING = 256
"""The waiting requests whose lengths the stats list (``EngineStats.waiting_steps``); with more
waiting than that, any prediction is infinite (a request behind 256 others is late)."""


def steps_left(num_uncomputed: int, max_tokens: int, num_output_tokens: int, token_budget: int) -> int:
    """Steps a request needs at most to finish: its known tokens still without K/V
    (``num_tokens - num_computed_tokens``: the prompt, or prompt and output again after a
    preemption, or the one last token while decoding) in steps of ``token_budget`` tokens, the
    last of which samples its next token, then one step per further token it may generate."""
    if num_output_tokens >= max_tokens:
        return 0 if max_tokens > 0 else -(-max(0, num_uncomputed) // max(1, token_budget))
    return -(-max(1, num_uncomputed) // max(1, token_budget)) + max_tokens - num_output_tokens - 1


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of an engine's load. Counts are requests (``num_running``, ``num_waiting``,
    ``num_slots`` = ``max_num_seqs``), KV blocks, steps and prompt tokens (the prefix-cache
    counters, since start); ``kv_cache_usage`` is the fraction of blocks in use (0 to 1)."""

    num_slots: int
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float
    num_preemptions: int
    num_steps: int
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache, since start
    prefix_cache_hits: int = 0  # of those, tokens found cached
    num_cached_blocks: int = 0  # blocks in the prefix cache now (owned or free)
    head_waiting_since: float | None = None  # arrival (time.monotonic()) of the longest-waiting request; None: none waits
    # Priority scheduling policy only (else empty): ((priority, running + waiting requests), ...),
    # lowest value first, at most 16 pairs (replica.core.waiting_queue.priority_counts).
    priority_counts: tuple[tuple[int, int], ...] = ()
    # Admission by latency target (replica.engine.admission): the step cost's weighted mean
    # (seconds; None before the first timed step), the token budget per step, each running
    # request's steps left at most (ascending), and each waiting request's (priority, steps at
    # most) in queue order (the first MAX_LISTED_WAITING).
    step_time_s: float | None = None
    token_budget: int = 0
    seat_steps: tuple[int, ...] = ()
    waiting_steps: tuple[tuple[int, int], ...] = ()

    def queue_wait_s(self, now: float) -> float:
        """How long (seconds) the longest-waiting request has waited for a seat at ``now``
        (``time.monotonic()``); 0 when none waits."""
        return 0.0 if self.head_waiting_since is None else max(0.0, now - self.head_waiting_since)

    @property
    def slot_utilization(self) -> float:
        """Fraction of seats taken (0 to 1)."""
        return self.num_running / self.num_slots

    @classmethod
    def of(cls, scheduler: Scheduler, block_manager: BlockManager, step_time_s: float | None = None) -> "EngineStats":
        """The snapshot of ``scheduler`` and ``block_manager`` now; ``step_time_s``: the step
        cost's weighted mean (:func:`replica.engine.admission.update_step_cost`)."""
        budget = scheduler.max_num_batched_tokens
        return cls(
            num_slots=scheduler.max_num_seqs,
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            num_free_blocks=block_manager.num_free_blocks,
            num_total_blocks=block_manager.num_blocks,
            kv_cache_usage=block_manager.usage,
            num_preemptions=scheduler.num_preemptions,
            num_steps=scheduler.step_count,
            prefix_cache_queries=scheduler.prefix_cache_queries,
            prefix_cache_hits=scheduler.prefix_cache_hits,
            num_cached_blocks=block_manager.num_cached_blocks,
            head_waiting_since=_oldest_arrival(scheduler),
            priority_counts=priority_counts(scheduler.requests.values()) if scheduler.scheduling_policy == "priority" else (),
            step_time_s=step_time_s,
            token_budget=budget,
            seat_steps=tuple(sorted(_steps_left(r, budget) for r in scheduler.running)),
            waiting_steps=tuple((r.priority, _steps_left(r, budget)) for r in islice(scheduler.waiting, MAX_LISTED_WAITING)),
        )


@dataclass(frozen=True)
class StepRow:
    """One request's row of a step: the step computes tokens ``[start, start + num_tokens)`` of
    the request (its prompt, then its output), drafts to verify included.

    ``start`` of a request's first row is how many of its prompt tokens the prefix cache held.
    ``is_prefill``: the row computes prompt tokens (``start`` below the prompt's length: a new
    request, a chunk of a long prompt, or a preempted request computing its prompt again); else
    it is a decode row. ``is_padding`` (static policy only): the row of a finished batch member,
    computed as a padded static batch would and thrown away.
    """

    request_id: str
    start: int
    num_tokens: int
    is_prefill: bool
    is_padding: bool = False


@dataclass(frozen=True)
class StepRecord:
    """One engine step that scheduled work, as :meth:`LLMEngine.add_step_observer
    <replica.engine.llm_engine.LLMEngine.add_step_observer>`'s callbacks receive it: plain data,
    immutable, no engine objects (requests are named by id).

    * ``step``: the step's number: the ``n``-th step of the engine's current scheduler that
      scheduled at least one row (:attr:`EngineStats.num_steps` after it);
    * ``rows``: the scheduled rows, in the forward's order;
    * ``running``: ids of the requests holding a seat after the step (the ones it finished have
      left), oldest admission first;
    * ``preempted``: ids of the requests preempted to make room for this step (back to waiting,
      their blocks freed);
    * ``num_free_blocks``, ``num_total_blocks``: the KV pool after the step, in blocks;
    * ``started``: ``time.monotonic()`` when ``step()`` began; ``duration_s``: seconds until the
      record was made (schedule, forward, sampling, update, detokenizing).

    With async scheduling a ``step()`` call schedules and launches this step and finishes the
    previous one: its rows' tokens come out of the next call.
    """

    step: int
    rows: tuple[StepRow, ...]
    running: tuple[str, ...]
    preempted: tuple[str, ...]
    num_free_blocks: int
    num_total_blocks: int
    started: float
    duration_s: float

    @property
    def num_batched_tokens(self) -> int:
        """Tokens the step's forward computed (every row's, padding included)."""
        return sum(row.num_tokens for row in self.rows)

    @property
    def num_prefill_rows(self) -> int:
        return sum(row.is_prefill and not row.is_padding for row in self.rows)

    @property
    def num_decode_rows(self) -> int:
        """Decode rows, padding rows left out."""
        return sum(not row.is_prefill and not row.is_padding for row in self.rows)

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks

    @classmethod
    def of(
        cls, out: SchedulerOutput, scheduler: Scheduler, block_manager: BlockManager, started: float, now: float
    ) -> "StepRecord":
        """The record of ``out`` (just run by ``scheduler``'s engine) at ``now`` (``time.monotonic()``)."""
        return cls(
            step=out.step,
            rows=tuple(
                StepRow(s.request.request_id, s.start, s.num_new_tokens, s.start < s.request.num_prompt_tokens, s.is_padding)
                for s in out.scheduled
            ),
            running=tuple(r.request_id for r in scheduler.running),
            preempted=tuple(r.request_id for r in out.preempted),
            num_free_blocks=block_manager.num_free_blocks,
            num_total_blocks=block_manager.num_blocks,
            started=started,
            duration_s=now - started,
        )


@dataclass(frozen=True)
class EngineInfo:
    """What an engine is and how it runs, as :meth:`LLMEngine.info
    <replica.engine.llm_engine.LLMEngine.info>` reports it now.

    ``model``: as configured (``EngineConfig.model``); ``model_path``: the local folder it was
    loaded from; ``dtype``: the weights' and KV cache's dtype by name (``"bfloat16"``,
    ``"float32"``); ``device``: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``; ``block_size``: tokens
    per KV block; ``num_blocks``: KV blocks in the pool; ``max_model_len``: tokens per request
    (prompt and output); ``max_num_seqs``: seats; ``max_num_batched_tokens``: a step's token
    budget; ``batching_policy``: ``"continuous"`` or ``"static"``, ``scheduling_policy``: ``"fcfs"``
    or ``"priority"`` (both may change on an idle engine); ``async_scheduling``: whether steps
    overlap under that policy; ``cuda_graphs``: whether decode steps replay captured CUDA graphs; ``speculative_config``: the speculative
    decoding settings as a dict of their fields, or None.
    """

    model: str
    model_path: str
    dtype: str
    device: str
    block_size: int
    num_blocks: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    scheduling_policy: str
    batching_policy: str
    async_scheduling: bool
    cuda_graphs: bool
    enable_prefix_caching: bool
    tensor_parallel_size: int
    speculative_config: dict | None = None


def _steps_left(request, token_budget: int) -> int:
    """Steps ``request`` needs at most to finish (:func:`steps_left`)."""
    return steps_left(
        request.num_tokens - request.num_computed_tokens,
        request.sampling_params.max_tokens, request.num_output_tokens, token_budget,
    )


def _oldest_arrival(scheduler) -> float | None:
    """Arrival of the longest-waiting request (None: none waits): the queue's head under ``fcfs``
    (a preempted request goes back to the front and arrived before the rest); under ``priority``
    the head is the most urgent, not the oldest, so all are looked at (O(waiting))."""
    if not scheduler.waiting:
        return None
    if scheduler.scheduling_policy != "priority":
        return scheduler.waiting[0].arrival_time
    return min(r.arrival_time for r in scheduler.waiting)
