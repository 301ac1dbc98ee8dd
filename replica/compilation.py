"""Fast paths for the model's dense part: oneDNN-prepacked linear layers on CPU, and torch.compile
of each decoder layer.

* **Prepacked linears (CPU, bf16/fp16).** torch's eager ``linear`` hands oneDNN a plain weight,
  which oneDNN reorders into its blocked layout on every call; at decode batch sizes that reorder
  costs about as much as the matmul (measured: 30 SmolLM2 layers at 4 tokens, 32.5 ms eager vs
  18.0 ms prepacked, one thread). :func:`prepack_linears` reorders each weight once
  (``torch.ops.mkldnn._reorder_linear_weight``, what inductor's freezing does) and routes the
  layer through ``carpool::packed_linear``, an opaque custom op around
  ``torch.ops.mkldnn._linear_pointwise``. Results are bit-identical to ``F.linear``.
* **Compiled decoder layers.** :func:`compile_decoder_layers` compiles every decoder layer with
  ``torch.compile`` (inductor): norms, rotary, activations and residual adds fuse into a few
  kernels and the per-op Python dispatch disappears; attention stays the opaque
  ``carpool::paged_attention`` op. All layers share one compiled graph (the weights and caches are
  its inputs), so compile time does not grow with depth. A step's sizes (tokens, block-table width)
  become symbolic once they have been seen to change (dynamo's automatic dynamic shapes; sizes of
  1 keep a graph of their own), which the engine's warm-up does before serving. Compiled code is cached on disk
  (:func:`use_compile_cache`), so a restart loads it instead of compiling again.
"""

from __future__ import annotations

import logging
import os
import types

import torch

logger = logging.getLogger(__name__)


@torch.library.custom_op("carpool::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``x @ W.T + bias`` with a weight prepacked by ``torch.ops.mkldnn._reorder_linear_weight``.

    ``x`` ``[..., in_features]`` → ``[..., out_features]`` (same dtype)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


@packed_linear.register_fake
def _(x, packed_weight, bias, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


def _packed_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.carpool.packed_linear(x, self.carpool_packed_weight, self.bias, self.out_features)


def prepack_linears(model: torch.nn.Module) -> int:
    """Route every ``nn.Linear`` of ``model`` through a oneDNN-prepacked copy of its weight.

    The original weight stays (the output embedding may be tied to the input embedding, and
    transformers reads weights' shapes and dtypes); the packed copy adds the same number of bytes.
    Returns the number of layers packed. Only for CPU models in bfloat16 or float16 with oneDNN.
    """
    if not torch.backends.mkldnn.is_available():
        return 0
    packed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.weight.device.type == "cpu":
            module.carpool_packed_weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach())
            module.forward = types.MethodType(_packed_forward, module)
            packed += 1
    return packed


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's stack of decoder layers: the ``ModuleList`` with ``num_hidden_layers`` entries.

    Raises ``ValueError`` if there is none (an architecture this module does not know).
    """
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == config.num_hidden_layers:
            return module
    raise ValueError(f"no list of {config.num_hidden_layers} decoder layers in {type(model).__name__}")


def use_compile_cache(directory: str) -> None:
    """Keep inductor's compiled code under ``directory`` (unless ``TORCHINDUCTOR_CACHE_DIR`` is set),
    so that it survives restarts (the default, /tmp, may not)."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", directory)


def compile_decoder_layers(model: torch.nn.Module) -> int:
    """torch.compile every decoder layer of ``model`` in place; returns how many.

    The first calls compile (see the module docstring); callers warm up before serving.
    """
    import torch._dynamo

    # Every layer shares one graph; its integer attributes (layer_idx) must not be baked in.
    torch._dynamo.config.allow_unspec_int_on_nn_module = True
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(options={"guard_filter_fn": _skip_module_guards})
    return len(layers)


def _skip_module_guards(guard_entries) -> list[bool]:
    """Drop dynamo's guards on the layer modules' attributes, except those on their tensors (dtype,
    shape, strides: cheap C++ checks), and keep every guard on the call's arguments (which path a
    step takes, e.g. ``carpool_decode``). A module that never changes is otherwise re-checked at
    every layer call, about 0.1 ms each. What this gives up: two models of one architecture with
    identical tensor shapes but a different non-tensor attribute (an attention scale, say) in one
    process would share a compiled layer."""
    return [
        entry.guard_type == "TENSOR_MATCH" or not entry.orig_guard.source.is_unspecialized_nn_module()
        for entry in guard_entries
    ]
