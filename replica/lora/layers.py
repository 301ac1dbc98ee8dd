"""LoRA'd linear layers: each adds its token's adapter delta to the base layer's output.

Every ``nn.Linear`` of the decoder layers gets ``max_loras`` device *slots*: the slots' ``A``
matrices stacked into one linear layer ``carpool_lora_a`` (``in_features`` -> ``L * R``, ``L`` =
``max_loras``, ``R`` = ``max_lora_rank``, slot ``s`` in rows ``s*R .. s*R + r``, zeros past an
adapter's rank ``r``) and their ``B`` matrices into ``carpool_lora_b`` (``L * R`` -> ``out_features``).
A step's tokens each carry a slot (``carpool_lora_slots``, ``[>= T]`` int64, one buffer shared by
every layer; ``L`` for the base model). The forward, for ``x`` ``[..., T, in_features]``::

    shrink = carpool_lora_a(x)                               # [..., T, L*R]: every slot's A x
    shrink = where(slot(token) == slot(column), shrink, 0)   # each token keeps its own slot's columns
    out = base(x) + carpool_lora_b(shrink) * scaling[slot]   # PEFT's base(x) + B(A(x)) * scaling

One dense shrink and one dense expand for the whole step, whatever its mix of adapters (vLLM's
"punica" idea of one batched LoRA matmul for mixed adapters, done here as two plain linear layers
and a mask): no gather, no per-adapter loop, fixed shapes, so it traces into the compiled decoder
and CUDA graphs as is. It computes the ``L * R`` columns of every token, where a gathered matmul
computes ``R``: at decode sizes the cost is reading the stacked weights, which a step with ``L``
adapters reads anyway. Both stacked layers are ordinary ``nn.Linear``s, so on CPU they go through
the same prepacked kernels as the base layers (``replica.worker.compilation.prepack_linears``:
a row's result never depends on the other rows of its step). A base token's delta is exactly 0,
so base requests keep their exact tokens; the masked columns add exact zeros, so an adapter's
token sums the same products as PEFT's ``lora_B(lora_A(x))``. A value another slot's columns
give a token (even one that overflows) never reaches it, and adapters with NaN or infinite
weights are refused at load (``replica.lora.adapter``).
"""

from __future__ import annotations

import types

import torch

__all__ = ["lora_targets", "install_lora", "wrap_forwards"]


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder's layer list (``layers``, or ``h`` as in Falcon).

    Raises ``ValueError`` when the model has none that Carpool can find."""
    decoder = model.get_decoder()
    for attr in ("layers", "h"):
        layers = getattr(decoder, attr, None)
        if isinstance(layers, torch.nn.ModuleList):
            return layers
    raise ValueError(f"{type(model).__name__}: no decoder layer list (layers or h) to put LoRA adapters on")


def lora_targets(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """The modules an adapter may adapt: every ``nn.Linear`` inside the decoder layers, by its name
    in ``model.named_modules()`` (``model.layers.0.self_attn.q_proj``: PEFT's key without its
    ``base_model.model.`` prefix)."""
    inside = {id(module) for layer in decoder_layers(model) for module in layer.modules()}
    return {
        name: module for name, module in model.named_modules()
        if id(module) in inside and isinstance(module, torch.nn.Linear)
    }


def install_lora(
    modules: dict[str, torch.nn.Linear], *, max_loras: int, max_rank: int, slots: torch.Tensor
) -> None:
    """Give each module its zeroed stacked slot layers and scaling, and the shared token-slot
    buffer ``slots`` (``[max tokens]`` int64 on the model's device). Call before
    ``prepack_linears`` (which packs the stacked layers too), then :func:`wrap_forwards`."""
    columns = torch.arange(max_loras, device=slots.device).repeat_interleave(max_rank)  # [L*R]: each column's slot
    for module in modules.values():
        weight = module.weight
        kw = {"bias": False, "dtype": weight.dtype, "device": weight.device}
        module.carpool_lora_a = torch.nn.Linear(module.in_features, max_loras * max_rank, **kw)
        module.carpool_lora_b = torch.nn.Linear(max_loras * max_rank, module.out_features, **kw)
        for layer in (module.carpool_lora_a, module.carpool_lora_b):
            layer.requires_grad_(False)
            layer.weight.zero_()
        module.register_buffer("carpool_lora_slots", slots, persistent=False)
        module.register_buffer("carpool_lora_columns", columns, persistent=False)
        # [L + 1] float32: each slot's scaling, 0 for the base model (index L)
        module.register_buffer("carpool_lora_scaling", torch.zeros(max_loras + 1, device=slots.device), persistent=False)


def wrap_forwards(modules: dict[str, torch.nn.Linear]) -> None:
    """Route each module through :func:`_lora_forward` around its current forward (after prepacking:
    the packed one)."""
    for module in modules.values():
        module.carpool_base_forward = module.forward
        module.forward = types.MethodType(_lora_forward, module)


def _lora_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., T, in_features]`` -> ``[..., T, out_features]``: the base output plus each
    token's adapter delta (see the module docstring)."""
    out = self.carpool_base_forward(x)
    slots = self.carpool_lora_slots[: x.shape[-2]]
    mine = slots.unsqueeze(-1) == self.carpool_lora_columns  # [T, L*R]
    # where, not a product with 0/1: another slot's column that overflowed to inf must give 0, not NaN
    delta = self.carpool_lora_b(torch.where(mine, self.carpool_lora_a(x), 0.0))
    return out + (delta * self.carpool_lora_scaling[slots].unsqueeze(-1)).to(out.dtype)
