""":class:`~replica.engine.llm_engine.LLMEngine`'s read side: what it reports about itself.

Its load after each change (:meth:`~EngineReporting.stats`), its settings as they took effect
(:meth:`~EngineReporting.info`), LoRA's and speculative decoding's counters, a record of every
step to the callbacks that asked for one (:meth:`~EngineReporting.add_step_observer`: the
benchmarks' step accounting reads the engine through it and nothing else), the forward's cost by
step size, and the KV block accounting check. Each is a public seam over the engine's parts, so
that no caller reads the scheduler, the block manager or the model runner itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from replica.engine.admission import update_step_cost
from replica.engine.stats import EngineInfo, EngineStats, SpecDecodeStats, StepRecord

logger = logging.getLogger("replica.engine.llm_engine")

StepObserver = Callable[[StepRecord], None]


class EngineReporting:
    """Mixed into :class:`~replica.engine.llm_engine.LLMEngine`; reads the engine's ``config``,
    ``model_path``, ``max_model_len``, ``runner``, ``scheduler``, ``block_manager``, ``lora``,
    ``speculator`` and ``metrics``, and its ``async_scheduling`` property."""

    _step_observers: tuple[StepObserver, ...] = ()
    _observers_lock = threading.Lock()  # adding and removing only; the engine's thread reads the tuple
    _step_cost: float | None = None  # seconds, the weighted mean of the steps that ran work

    # ---- step observers ----------------------------------------------------------------------
    def add_step_observer(self, callback: StepObserver) -> Callable[[], None]:
        """Call ``callback(record)`` with a :class:`~replica.engine.stats.StepRecord` at the end
        of every ``step()`` that scheduled work or preempted (failed steps included), on the engine's thread,
        after the engine's stats are refreshed; returns a function that removes it (idempotent).

        A callback should be quick: the step waits for it. One that raises is logged and removed,
        so that it cannot fail the step's requests. Thread-safe. Without observers the engine
        builds no records.
        """
        with self._observers_lock:
            self._step_observers = (*self._step_observers, callback)

        def remove() -> None:
            with self._observers_lock:
                self._step_observers = tuple(c for c in self._step_observers if c is not callback)

        return remove

    def _notify_step(self, out, started: float) -> None:
        """Hand the record of ``out`` (a step just run; ``started``: its ``time.monotonic()``) to the observers."""
        observers = self._step_observers
        if not observers or (out.is_empty and not out.preempted):
            return
        record = StepRecord.of(out, self.scheduler, self.block_manager, started, time.monotonic())
        for callback in observers:
            try:
                callback(record)
            except Exception:
                logger.exception("step observer %r failed; it is removed", callback)
                with self._observers_lock:
                    self._step_observers = tuple(c for c in self._step_observers if c is not callback)

    # ---- settings and state ------------------------------------------------------------------
    def info(self) -> EngineInfo:
        """The engine's settings as they took effect (:class:`~replica.engine.stats.EngineInfo`):
        resolved dtype, KV blocks, the current batching and scheduling policies and whether it schedules
        asynchronously, CUDA graphs. Call it on the engine's thread or while it is idle."""
        cfg, runner = self.config, self.runner
        return EngineInfo(
            model=cfg.model, model_path=str(self.model_path), dtype=str(runner.dtype).removeprefix("torch."),
            device=str(runner.device), block_size=self.block_manager.block_size, num_blocks=self.block_manager.num_blocks,
            max_model_len=self.max_model_len, max_num_seqs=self.scheduler.max_num_seqs,
            max_num_batched_tokens=self.scheduler.max_num_batched_tokens,
            scheduling_policy=self.scheduler.scheduling_policy, batching_policy=self.scheduler.batching_policy,
            async_scheduling=bool(self.async_scheduling), cuda_graphs=bool(runner.use_cuda_graphs),
            enable_prefix_caching=cfg.enable_prefix_caching, tensor_parallel_size=cfg.tensor_parallel_size,
            speculative_config=cfg.speculative_config.model_dump() if cfg.speculative_config is not None else None,
        )

    def stats(self) -> EngineStats:
        """The engine's load after its latest change (step, add or abort). An immutable snapshot,
        so another thread may read it while the engine steps (``AsyncLLMEngine`` does)."""
        return self._stats

    def _refresh_stats(self, step_s: float | None = None) -> None:
        """Take the load snapshot that :meth:`stats` returns, once per change (a step, an added or
        aborted request), and set the metrics' gauges from it. ``step_s``: the seconds of the step
        that just ran work, folded into the step cost's mean (``EngineStats.step_time_s``)."""
        if step_s is not None:
            self._step_cost = update_step_cost(self._step_cost, step_s)
        self._stats = stats = EngineStats.of(self.scheduler, self.block_manager, self._step_cost)
        self._lora_stats = self.lora.snapshot(self.scheduler) if self.lora is not None else None
        if self.metrics is not None:
            self.metrics.on_state(
                num_slots=stats.num_slots, num_running=stats.num_running, num_waiting=stats.num_waiting,
                num_free_blocks=stats.num_free_blocks, num_total_blocks=stats.num_total_blocks,
            )

    def lora_stats(self) -> dict | None:
        """LoRA's state (:meth:`EngineLoRA.snapshot <replica.engine.lora_support.EngineLoRA.snapshot>`;
        None without LoRA); thread-safe: requests and slots as of the engine's latest change, the
        adapters in host memory as of now."""
        stats = self._lora_stats
        return None if stats is None else {**stats, "cached": self.lora.registry.names()}

    @property
    def spec_decode_stats(self) -> SpecDecodeStats:
        """Speculative decoding's counters since start (all zero without speculation)."""
        return self.speculator.stats if self.speculator is not None else SpecDecodeStats()

    def time_forwards(self, num_tokens: list[int], chunk: int) -> list[float]:
        """Seconds of one forward of each of ``num_tokens`` tokens, as sequences of ``chunk``
        tokens (the step cost the speculative planner is seeded with;
        :func:`replica.worker.warm_up.time_forwards`). Only on an idle engine, on its thread:
        the forwards use the KV pool's padding slot and the model's buffers."""
        return self.runner.time_forwards(num_tokens, chunk)

    def check_integrity(self) -> None:
        """Block accounting holds, and every block's owner is a live request (``AssertionError`` otherwise)."""
        self.block_manager.check_integrity()
        live = {r.request_id for r in self.scheduler.running} | {r.request_id for r in self.scheduler.waiting}
        leaked = set(self.block_manager.owners()) - live
        if leaked:
            raise AssertionError(f"blocks held by finished requests: {sorted(leaked)}")
