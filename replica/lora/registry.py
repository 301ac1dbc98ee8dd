"""The adapters one engine knows, in host memory: read on first use, least recently used dropped
past ``max_cpu_loras`` (vLLM's host LRU). Thread-safe: requests are built in callers' threads."""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from replica.lora.adapter import LoRAAdapter, load_adapter
from replica.protocol.lora_request import LoRARequest


class LoRARegistry:
    """``(lora_name, lora_path)`` -> :class:`LoRAAdapter`, at most ``max_cpu_loras`` of them.

    An adapter dropped from here (LRU or :meth:`remove`) is read again from its folder when a
    later request names it; requests already holding it keep it (their ``Request.lora``).

    Args:
        linear_shapes, max_rank, dtype: as :func:`~replica.lora.adapter.load_adapter` takes them.
        max_cpu_loras: adapters kept in host memory at most.
    """

    def __init__(self, *, linear_shapes: dict[str, tuple[int, int]], max_rank: int, dtype: torch.dtype, max_cpu_loras: int) -> None:
        self.linear_shapes = linear_shapes
        self.max_rank = max_rank
        self.dtype = dtype
        self.max_cpu_loras = max_cpu_loras
        self._adapters: OrderedDict[tuple[str, str], LoRAAdapter] = OrderedDict()
        self._lock = threading.Lock()
        self.num_reads = 0  # adapters read from disk since start

    def get(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter of ``request``, read now if it is not in memory (the most recently used after).

        Raises ``LoRAAdapterError`` (see :func:`~replica.lora.adapter.load_adapter`)."""
        with self._lock:
            adapter = self._adapters.get(request.key)
            if adapter is not None:
                self._adapters.move_to_end(request.key)
                return adapter
        adapter = load_adapter(request, linear_shapes=self.linear_shapes, max_rank=self.max_rank, dtype=self.dtype)
        with self._lock:
            adapter = self._adapters.setdefault(request.key, adapter)  # a racing reader's copy wins
            self._adapters.move_to_end(request.key)
            self.num_reads += 1
            while len(self._adapters) > self.max_cpu_loras:
                self._adapters.popitem(last=False)
        return adapter

    def has(self, request: LoRARequest) -> bool:
        """Whether ``request``'s adapter is in host memory now (a request naming it reads no file)."""
        with self._lock:
            return request.key in self._adapters

    def remove(self, lora_name: str) -> bool:
        """Forget every adapter named ``lora_name``; returns whether there was one."""
        with self._lock:
            keys = [key for key in self._adapters if key[0] == lora_name]
            for key in keys:
                del self._adapters[key]
        return bool(keys)

    def names(self) -> list[str]:
        """Names of the adapters in host memory, least recently used first."""
        with self._lock:
            return [key[0] for key in self._adapters]
