"""The engine's side of LoRA: the adapter registry, a request's adapter, the LoRA snapshot that
``LLMEngine.lora_stats`` hands other threads (the replica's metrics and routing stats), and the
engine's adapter methods (``add_lora``, ``activate_lora``, ``remove_lora``)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from replica.config.engine_config import EngineConfig
from replica.core.lora_limit import running_loras
from replica.kernels.shapes import padded_size
from replica.lora.adapter import LoRAAdapter
from replica.lora.registry import LoRARegistry
from replica.protocol.errors import LoRAAdapterError
from replica.protocol.lora_request import LoRARequest


def runner_lora(cfg: EngineConfig) -> tuple[int, int, int] | None:
    """``ModelRunner``'s ``lora`` argument: ``(max_loras, max_lora_rank, max step tokens)``, where
    a step has at most the budget's padded size (:func:`padded_size`) or a row per seat."""
    if not cfg.enable_lora:
        return None
    return cfg.max_loras, cfg.max_lora_rank, max(padded_size(cfg.max_num_batched_tokens), cfg.max_num_seqs, 16)


class EngineLoRA:
    """The adapters an engine serves (its runner has LoRA slots: ``runner.lora``)."""

    def __init__(self, cfg: EngineConfig, runner) -> None:
        self.slots = runner.lora
        shapes = {name: (m.out_features, m.in_features) for name, m in self.slots.modules.items()}
        self.registry = LoRARegistry(
            linear_shapes=shapes, max_rank=cfg.max_lora_rank, dtype=runner.dtype,
            max_cpu_loras=cfg.max_cpu_loras or cfg.max_loras,
        )
        self.max_loras = cfg.max_loras

    def adapter_for(self, lora_request: LoRARequest) -> LoRAAdapter:
        """The request's adapter, read from its folder on first use (thread-safe).

        Raises ``LoRAAdapterError`` naming the reason."""
        if not isinstance(lora_request, LoRARequest):
            raise LoRAAdapterError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        return self.registry.get(lora_request)

    def activate(self, adapter: LoRAAdapter, running) -> bool:
        """Put ``adapter`` in a device slot now, sparing the adapters of the ``running`` requests
        (as a step that runs it would: :meth:`LoRASlots.prepare <replica.lora.slots.LoRASlots.prepare>`
        with one one-token row); returns whether a slot was written. Raises ``RuntimeError`` when
        every slot holds a running request's adapter."""
        loads = self.slots.num_loads
        self.slots.prepare([adapter], np.ones(1, dtype=np.int64), running_loras(running))
        return self.slots.num_loads > loads

    def snapshot(self, scheduler) -> dict[str, Any]:
        """``max_loras``; ``loaded`` (adapters in device slots), ``cached`` (in host memory);
        ``running`` and ``waiting`` requests per adapter name; ``num_slot_loads`` (adapters written
        into a slot since start). Called on the engine's thread."""
        def per_adapter(requests) -> dict[str, int]:
            return dict(Counter(r.lora.name for r in requests if r.lora is not None))

        return {
            "max_loras": self.max_loras,
            "loaded": self.slots.loaded(),
            "cached": self.registry.names(),
            "running": per_adapter(scheduler.running),
            "waiting": per_adapter(scheduler.waiting),
            "num_slot_loads": self.slots.num_loads,
        }


def check_lora_request(lora: EngineLoRA | None, lora_request: LoRARequest | None) -> LoRAAdapter | None:
    """The adapter of a request's ``lora_request`` (None: the base model).

    Raises ``LoRAAdapterError`` when one is named and LoRA is not enabled, or it cannot be used."""
    if lora_request is None:
        return None
    if lora is None:
        raise LoRAAdapterError("this engine does not serve LoRA adapters (start it with enable_lora)")
    return lora.adapter_for(lora_request)


class EngineLoRAMethods:
    """``LLMEngine``'s adapter methods (vLLM's names), mixed in; they use the engine's ``lora``
    (an :class:`EngineLoRA`, None without LoRA), ``scheduler`` and ``_refresh_stats``. What the
    engine reports about its adapters is ``replica.engine.reporting``'s."""

    def add_lora(self, lora_request: LoRARequest) -> dict:
        """Read and check an adapter into host memory now (vLLM's ``add_lora``), so that the
        requests naming it read no file: ``{"name", "path", "rank", "target_modules"}``.
        Thread-safe; reads files. Raises ``LoRAAdapterError`` naming the reason (or that LoRA is
        not enabled)."""
        adapter = check_lora_request(self.lora, lora_request)
        return {"name": adapter.name, "path": lora_request.lora_path, "rank": adapter.rank,
                "target_modules": adapter.target_modules}

    def activate_lora(self, lora_request: LoRARequest) -> bool:
        """Write an adapter into a device slot now rather than in the first step that runs it
        (read first, as :meth:`add_lora`, unless in host memory); the slot of the least used
        adapter that no running request holds is taken. Returns whether a slot was written
        (False: it was in one). On the engine's thread. Raises ``LoRAAdapterError`` as
        :meth:`add_lora`, ``RuntimeError`` when running requests hold every slot."""
        adapter = check_lora_request(self.lora, lora_request)  # raises first without LoRA
        written = self.lora.activate(adapter, self.scheduler.running)
        self._refresh_stats()  # lora_stats()'s "loaded"
        return written

    def remove_lora(self, lora_name: str) -> bool:
        """Forget the adapter(s) named ``lora_name`` from host memory (thread-safe); requests
        holding one keep it. Returns whether one was known (False without LoRA)."""
        return self.lora is not None and self.lora.registry.remove(lora_name)
