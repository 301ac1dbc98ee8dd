"""A snapshot of an engine's load: what the router, the metrics and the health check read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from replica.spec_decode.stats import SpecDecodeStats

__all__ = ["EngineStats", "SpecDecodeStats"]

if TYPE_CHECKING:
    from replica.core.block_manager import BlockManager
    from replica.core.scheduler import Scheduler


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
    head_waiting_since: float | None = None  # arrival (time.monotonic()) of the next request to admit; None: none waits

    def queue_wait_s(self, now: float) -> float:
        """How long (seconds) the head of the waiting queue has waited for a seat at ``now``
        (``time.monotonic()``); 0 when none waits."""
        return 0.0 if self.head_waiting_since is None else max(0.0, now - self.head_waiting_since)

    @property
    def slot_utilization(self) -> float:
        """Fraction of seats taken (0 to 1)."""
        return self.num_running / self.num_slots

    @classmethod
    def of(cls, scheduler: Scheduler, block_manager: BlockManager) -> "EngineStats":
        """The snapshot of ``scheduler`` and ``block_manager`` now."""
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
            head_waiting_since=scheduler.waiting[0].arrival_time if scheduler.waiting else None,
        )

