"""Which adapter sits in which of the ``max_loras`` device slots, and each step's token slots.

A step's adapters are put in slots before its forward (:meth:`LoRASlots.prepare`): an adapter
already in a slot stays; another takes a free slot, else, among the slots whose adapter no running
request holds (the scheduler keeps at most ``max_loras`` distinct adapters running, so there is
always one), the *coldest*: each slot's heat is the number of steps its adapter ran in, decayed
by :data:`HEAT_DECAY` per step (LFU with aging, as in cache replacement since LRFU, Lee et al.
2001), ties to the least recently used. A popular adapter idle for a moment then keeps its slot,
and the rarely used ones take turns in the others, where plain LRU would evict the popular one
for whichever rare adapter came last. Taking a slot writes the adapter's A and B into the slot's rows
of every LoRA'd layer's stacked weights (:mod:`replica.lora.layers`) and its scaling; layers the
adapter does not adapt get zeros there.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np
import torch

from replica.lora.adapter import LoRAAdapter

HEAT_DECAY = 0.98
"""A slot's heat is multiplied by this every step (half-life about 34 steps)."""


class LoRASlots:
    """The slots of one engine's LoRA'd layers.

    Args:
        modules: the LoRA'd layers by name (:func:`replica.lora.layers.lora_targets`), after
            :func:`~replica.lora.layers.install_lora`.
        max_loras, max_rank: slots, and rows per slot.
        slots: the token-slot buffer the layers read (``[max tokens]`` int64).
    """

    def __init__(self, modules: dict[str, torch.nn.Linear], *, max_loras: int, max_rank: int, slots: torch.Tensor) -> None:
        self.modules = modules
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.none = max_loras  # the base model's slot index
        self.buffer = slots
        self.buffer.fill_(self.none)
        # Host copies of each layer's stacked weights: a slot's rows are written here, then packed.
        self._a = {name: torch.zeros(m.carpool_lora_a.out_features, m.in_features, dtype=m.weight.dtype) for name, m in modules.items()}
        self._b = {name: torch.zeros(m.out_features, m.carpool_lora_b.in_features, dtype=m.weight.dtype) for name, m in modules.items()}
        self._written: list[set[str]] = [set() for _ in range(max_loras)]  # layers with nonzero rows per slot
        self.adapters: list[LoRAAdapter | None] = [None] * max_loras
        self._last_used = [0] * max_loras
        self._heat = [0.0] * max_loras
        self._clock = 0
        self._filled = 0  # buffer entries that may hold a slot other than none
        self.num_loads = 0  # adapters written into a slot since start

    def loaded(self) -> list[str]:
        """Names of the adapters in slots."""
        return [a.name for a in self.adapters if a is not None]

    def prepare(self, row_adapters: Sequence[LoRAAdapter | None], query_lens: np.ndarray, keep: Collection[LoRAAdapter]) -> None:
        """Put this step's adapters in slots and fill the token-slot buffer: row ``i`` (of
        ``query_lens[i]`` tokens, in the step's token order) gets its adapter's slot.

        ``keep``: adapters of running requests, not evicted for this step's (any slot whose
        adapter is in neither may be reused). Raises ``RuntimeError`` if the step needs more
        slots than there are (the scheduler prevents it)."""
        self._clock += 1
        self._heat = [h * HEAT_DECAY for h in self._heat]
        slot_of: dict[int, int] = {}
        row_slots = np.full(len(row_adapters), self.none, dtype=np.int64)
        for i, adapter in enumerate(row_adapters):
            if adapter is None:
                continue
            slot = slot_of.get(id(adapter))
            if slot is None:
                slot = slot_of[id(adapter)] = self._slot_for(adapter, slot_of.values(), keep)
            row_slots[i] = slot
        for slot in slot_of.values():
            self._heat[slot] += 1.0
        token_slots = np.repeat(row_slots, query_lens)
        n = len(token_slots)
        if n > len(self.buffer):
            raise RuntimeError(f"a step of {n} tokens exceeds the LoRA slot buffer ({len(self.buffer)})")
        if self._filled > n:
            self.buffer[n : self._filled].fill_(self.none)
        self.buffer[:n].copy_(torch.from_numpy(token_slots))
        self._filled = n

    def _slot_for(self, adapter: LoRAAdapter, taken: Collection[int], keep: Collection[LoRAAdapter]) -> int:
        for slot, held in enumerate(self.adapters):
            if held is adapter:
                self._last_used[slot] = self._clock
                return slot
        free = [s for s, held in enumerate(self.adapters) if held is None]
        if not free:
            free = [s for s, held in enumerate(self.adapters) if s not in taken and held not in keep]
        if not free:
            free = [s for s in range(self.max_loras) if s not in taken]
        if not free:
            raise RuntimeError(f"a step holds more than max_loras={self.max_loras} adapters")
        slot = min(free, key=lambda s: (self._heat[s], self._last_used[s]))
        self._write(slot, adapter)
        self._heat[slot] = 0.0
        self._last_used[slot] = self._clock
        return slot

    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        """Write ``adapter`` into ``slot`` of every layer (zeros where it adapts nothing)."""
        rows = slice(slot * self.max_rank, (slot + 1) * self.max_rank)
        written = set()
        for name, module in self.modules.items():
            weights = adapter.weights.get(name)
            if weights is None and name not in self._written[slot]:
                module.carpool_lora_scaling[slot] = 0.0
                continue
            a_all, b_all = self._a[name], self._b[name]
            a_all[rows].zero_()
            b_all[:, rows].zero_()
            scaling = 0.0
            if weights is not None:
                a, b, scaling = weights
                r = a.shape[0]
                a_all[slot * self.max_rank : slot * self.max_rank + r] = a
                b_all[:, slot * self.max_rank : slot * self.max_rank + r] = b
                written.add(name)
            device = module.carpool_lora_scaling.device
            repack_linear(module.carpool_lora_a, a_all.to(device))
            repack_linear(module.carpool_lora_b, b_all.to(device))
            module.carpool_lora_scaling[slot] = scaling
        self._written[slot] = written
        self.adapters[slot] = adapter
        self.num_loads += 1


def make_slots(model: torch.nn.Module, *, max_loras: int, max_rank: int, max_tokens: int) -> LoRASlots:
    """Install LoRA slots on every linear layer of ``model``'s decoder layers
    (:func:`~replica.lora.layers.install_lora`; before prepacking, then
    :func:`~replica.lora.layers.wrap_forwards`), with a token-slot buffer of ``max_tokens``."""
    from replica.lora.layers import install_lora, lora_targets

    modules = lora_targets(model)
    device = next(model.parameters()).device
    buffer = torch.full((max_tokens,), max_loras, dtype=torch.int64, device=device)
    install_lora(modules, max_loras=max_loras, max_rank=max_rank, slots=buffer)
    return LoRASlots(modules, max_loras=max_loras, max_rank=max_rank, slots=buffer)


def repack_linear(module: torch.nn.Linear, weight: torch.Tensor) -> None:
    """Give a layer that ``replica.worker.compilation.prepack_linears`` went over a new ``weight``
    (same shape and dtype), in place: its packed copy where it has one (the attributes that
    module's packers set; the compiled decoder and CUDA graphs keep reading the same tensors),
    else its plain weight."""
    if hasattr(module, "carpool_f32_weight"):
        module.carpool_f32_weight.copy_(torch.ops.carpool_cpu.pack_f32_weight(weight))
    elif getattr(module, "carpool_gemv_weight", None) is not None:
        module.carpool_gemv_weight.copy_(torch.ops.carpool_cpu.pack_bf16_weight(weight))
    elif hasattr(module, "carpool_packed_weight"):
        module.carpool_packed_weight.copy_(torch.ops.mkldnn._reorder_linear_weight(weight))
    else:
        module.weight.copy_(weight)
