"""Our paged attention, plugged into transformers models through ``AttentionInterface``.

The model runner packs every scheduled token of every request into one row (batch size 1,
``num_tokens`` positions). Every attention layer calls :func:`paged_attention_forward`, which
hands the layer's query, key and value to one opaque custom op, ``carpool::paged_attention``
(``torch.library.custom_op``): torch.compile fuses the dense code around it (norms, rotary,
activations, residual adds) and leaves attention to the backend. Per layer the op

1. writes the step's new K/V into the layer's paged cache at the step's ``slot_mapping``;
2. attends every sequence of the step (prefill chunks and decodes alike) through its block
   table, in one backend call.

The step's metadata (query offsets, context lengths, block tables) is planned once per step by the
engine's :class:`AttentionBackend` (:meth:`AttentionBackend.plan`), which every layer's op call
reads: the model runner runs the forward inside :func:`running_step`, which tells the op (on this
thread) whose step it is, so two engines in one process never see each other's steps. The layer's
K/V cache tensors are attributes of its attention module (``carpool_key_cache``,
``carpool_value_cache``), so that one compiled layer serves every layer. A step whose tokens all
attend as decode queries (decodes, and the tokens of prefill chunks) may instead pass a
:class:`DecodeStep` to the model call, and then attention is traced into the compiled layer.

This is PagedAttention's memory layout (Kwon et al. 2023, arXiv:2309.06180). The backend
interface is in :mod:`replica.attention.backend`, the backends in :mod:`replica.attention.reference`,
:mod:`replica.attention.cpu` and :mod:`replica.attention.cuda`.
"""

from __future__ import annotations

import math
import threading
from contextlib import contextmanager

import torch
from transformers import AttentionInterface

from replica.attention.backend import AttentionBackend, DecodeStep
from replica.attention.cpu_decode import decode_step_attention

ATTENTION_NAME = "carpool_paged"

_current = threading.local()  # the backend whose step this thread is running (see running_step)








@contextmanager
def running_step(backend: AttentionBackend):
    """Run a forward of ``backend``'s planned step on this thread: the attention op of every layer
    called inside reaches that backend. Each engine steps on one thread at a time, so two engines
    in one process never see each other's steps."""
    previous = getattr(_current, "backend", None)
    _current.backend = backend
    try:
        yield
    finally:
        _current.backend = previous


@torch.library.custom_op("carpool::paged_attention", mutates_args=("key_cache", "value_cache"))
def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One layer's paged attention over the step this thread is running (:func:`running_step`).
    ``query`` ``[T, H, D]``; ``key``, ``value`` ``[T, H_kv, D]``; returns ``[T, H, D]``.

    Raises ``RuntimeError`` outside :func:`running_step`."""
    backend = getattr(_current, "backend", None)
    if backend is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention runs only inside a model runner's step")
    return backend.forward(query, key, value, key_cache, value_cache, scale).contiguous()


@paged_attention.register_fake
def _(query, key, value, key_cache, value_cache, scale):
    # Contiguous, as the op returns, whatever the query's strides: partial-rotary layers (Phi,
    # GPT-NeoX, StableLM) build it with torch.cat, and inductor reads the output with these strides.
    return query.new_empty(query.shape)


# Keyword arguments transformers' layers pass to the attention function that do not change plain
# causal attention in inference (``dropout`` is applied only in training; the model's own forward
# arguments reach it too). Any other argument that is not None or False asks for attention this
# kernel does not compute.
IGNORED_ARGUMENTS = frozenset({
    "carpool_decode", "sliding_window", "is_causal", "position_ids", "cache_position", "use_cache",
    "output_attentions", "output_hidden_states", "output_router_logits", "return_dict", "logits_to_keep",
    "layer_idx", "deterministic",
})


def _check_attention_arguments(attention_mask: torch.Tensor | None, kwargs: dict) -> None:
    if attention_mask is not None:
        raise NotImplementedError(f"{ATTENTION_NAME} does not support an attention mask or bias of the model's own")
    if kwargs.get("is_causal") is False:
        raise NotImplementedError(f"{ATTENTION_NAME} computes causal attention only")
    unsupported = sorted(k for k, v in kwargs.items() if v is not None and v is not False and k not in IGNORED_ARGUMENTS)
    if unsupported:
        raise NotImplementedError(f"{ATTENTION_NAME} does not support {', '.join(unsupported)}")


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function over the paged cache.

    Args:
        module: the attention layer; :func:`attach_kv_cache` gave it its cache.
        query: ``[1, num_heads, num_tokens, head_dim]`` (RoPE applied).
        key, value: ``[1, num_kv_heads, num_tokens, head_dim]`` (GQA heads not repeated).
    Returns:
        ``([1, num_tokens, num_heads, head_dim], None)``.
    Raises:
        RuntimeError: the layer has no cache (the model is not run through ``ModelRunner``).
        NotImplementedError: for attention this kernel does not implement: an attention mask
            (the engine's models get None: a mask means the model adds a bias or a pattern of its
            own, as ALiBi does), ``is_causal=False``, any keyword argument outside
            ``IGNORED_ARGUMENTS`` that is not None or False (logit soft-capping, sinks, position biases,
            sparse indices, ...), or a sliding window shorter than the layer's
            ``carpool_max_model_len``, which :func:`set_max_model_len` gives (a window at least
            that long covers every sequence and changes nothing).
    """
    if not hasattr(module, "carpool_key_cache"):
        raise RuntimeError(f"{ATTENTION_NAME} attention needs a KV cache (run the model through ModelRunner)")
    _check_attention_arguments(attention_mask, kwargs)
    window = kwargs.get("sliding_window")
    if window is not None and window < getattr(module, "carpool_max_model_len", math.inf):
        raise NotImplementedError(f"{ATTENTION_NAME} does not support a sliding window shorter than max_model_len")
    head_dim = query.shape[-1]
    scale = scaling if scaling is not None else head_dim**-0.5
    decode: DecodeStep | None = kwargs.get("carpool_decode")
    if decode is not None:
        out = decode_step_attention(
            query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
            module.carpool_key_cache, module.carpool_value_cache, decode, scale,
        )
        return out.unsqueeze(0), None
    out = torch.ops.carpool.paged_attention(
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        module.carpool_key_cache,
        module.carpool_value_cache,
        float(scale),
    )
    return out.unsqueeze(0), None


def attach_kv_cache(model: torch.nn.Module, key_caches: list, value_caches: list) -> int:
    """Give every attention layer of ``model`` (:func:`cache_layers`) its K/V cache tensors. Returns the number of layers attached.

    Raises ``ValueError`` if the model's layer indices do not match the caches.
    """
    attached = 0
    for module in cache_layers(model):
        layer = module.layer_idx
        if not 0 <= layer < len(key_caches):
            raise ValueError(f"attention layer {layer} has no KV cache ({len(key_caches)} layers)")
        module.carpool_key_cache = key_caches[layer]
        module.carpool_value_cache = value_caches[layer]
        attached += 1
    if attached != len(key_caches):
        raise ValueError(f"found {attached} attention layers for {len(key_caches)} KV caches")
    return attached


def set_max_model_len(model: torch.nn.Module, max_model_len: int) -> None:
    """Tell every attention layer with a cache the longest sequence it will see (tokens), so that
    a sliding window at least that long is accepted (:func:`paged_attention_forward`)."""
    for module in model.modules():
        if hasattr(module, "carpool_key_cache"):
            module.carpool_max_model_len = max_model_len


def is_attention(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a transformers attention layer (its class name ends in ``Attention``)."""
    return type(module).__name__.endswith("Attention")


def cache_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder's attention layers, which get a KV cache: attention modules with an integer
    ``layer_idx`` and a ``config`` (a multimodal model's vision or audio attention has no
    ``layer_idx``)."""
    return [
        m for m in model.modules()
        if isinstance(getattr(m, "layer_idx", None), int) and hasattr(m, "config") and is_attention(m)
    ]


def register_paged_attention() -> str:
    """Register :func:`paged_attention_forward` with transformers (idempotent); returns its name."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    return ATTENTION_NAME
