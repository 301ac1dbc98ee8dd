"""The batching policies (``EngineConfig.batching_policy``) and the factory the engine builds its
scheduler with.

Plain Python, no torch. Each batching policy is a :class:`~replica.core.scheduler.Scheduler` class:
``"continuous"`` is :class:`~replica.core.scheduler.Scheduler` itself (iteration-level batching),
``"static"`` is :class:`~replica.core.static_batching.StaticBatchScheduler` (the baseline). Either
orders its waiting queue by the scheduling policy (``EngineConfig.scheduling_policy``: ``"fcfs"`` or
``"priority"``, :mod:`replica.core.waiting_queue`). An idle engine can change both
(``LLMEngine.set_batching_policy``, ``set_scheduling_policy``), as the benchmarks do.
"""

from __future__ import annotations

from typing import Literal

from replica.core.block_manager import BlockManager
from replica.core.scheduler import Scheduler
from replica.core.static_batching import StaticBatchScheduler
from replica.core.waiting_queue import SchedulingPolicy

__all__ = ["BatchingPolicy", "SCHEDULERS", "SchedulingPolicy", "make_scheduler"]

BatchingPolicy = Literal["continuous", "static"]

# Every batching policy's class, by name.
SCHEDULERS: dict[str, type[Scheduler]] = {cls.POLICY: cls for cls in (Scheduler, StaticBatchScheduler)}


def make_scheduler(
    batching_policy: BatchingPolicy,
    block_manager: BlockManager,
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    max_loras: int | None = None,
    scheduling_policy: SchedulingPolicy = "fcfs",
) -> Scheduler:
    """The scheduler of ``batching_policy`` over ``block_manager``, its waiting queue in
    ``scheduling_policy``'s order (the other arguments: :class:`Scheduler`'s).

    Raises:
        ValueError: an unknown policy, naming ``batching_policy`` or ``scheduling_policy``.
    """
    if batching_policy not in SCHEDULERS:
        raise ValueError(f"batching_policy must be 'continuous' or 'static', got {batching_policy!r}")
    return SCHEDULERS[batching_policy](
        block_manager,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        max_loras=max_loras,
        scheduling_policy=scheduling_policy,
    )
