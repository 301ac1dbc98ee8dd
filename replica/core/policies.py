"""The scheduling policies (``EngineConfig.scheduling_policy``) and the factory the engine builds its
scheduler with.

Plain Python, no torch. Each policy is a :class:`~replica.core.scheduler.Scheduler` class:
``"continuous"`` is :class:`~replica.core.scheduler.Scheduler` itself (iteration-level batching),
``"static"`` is :class:`~replica.core.static_batching.StaticBatchScheduler` (the baseline). An idle
engine can change its scheduler's policy (``LLMEngine.set_scheduling_policy``), as the benchmarks do.
"""

from __future__ import annotations

from typing import Literal

from replica.core.block_manager import BlockManager
from replica.core.scheduler import Scheduler
from replica.core.static_batching import StaticBatchScheduler

SchedulingPolicy = Literal["continuous", "static"]

# Every policy's class, by name.
SCHEDULERS: dict[str, type[Scheduler]] = {cls.POLICY: cls for cls in (Scheduler, StaticBatchScheduler)}


def make_scheduler(
    policy: SchedulingPolicy,
    block_manager: BlockManager,
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    max_loras: int | None = None,
) -> Scheduler:
    """The scheduler of ``policy`` over ``block_manager`` (the other arguments: :class:`Scheduler`'s).

    Raises:
        ValueError: an unknown policy.
    """
    if policy not in SCHEDULERS:
        raise ValueError(f"scheduling_policy must be 'continuous' or 'static', got {policy!r}")
    return SCHEDULERS[policy](
        block_manager,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        max_loras=max_loras,
    )
