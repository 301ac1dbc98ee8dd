"""The physical paged KV cache: one K and one V tensor per layer, addressed by slot.

A *slot* is one token's place in the pool: ``slot = block_id * block_size + offset`` (vLLM's
``slot_mapping``). Each layer's cache is stored flat as ``[num_blocks * block_size, num_kv_heads,
head_dim]`` so that writing a step's new K/V is one ``index_copy_`` at the step's slots; the
attention backends (``replica.attention.reference``) read it through block tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ModelShape:
    """What the KV cache must hold per token: ``num_layers`` × K/V of ``num_kv_heads × head_dim``;
    ``num_heads`` query heads attend to them. ``sliding_window``: the shortest attention window of
    any layer, in tokens (a query at position ``i`` sees keys ``j > i - sliding_window``, as
    transformers masks it), or None where every layer attends to its whole context.
    ``longrope_short_len``: for a longrope rotary embedding (Phi-3 128k, Phi-3.5), the tokens up to
    which it keeps its short factors (``original_max_position_embeddings``), else None."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int | None
    sliding_window: int | None = None
    longrope_short_len: int | None = None


def model_shape(hf_config, tp_size: int = 1) -> ModelShape:
    """Read the KV-relevant shape from a transformers config (its text config for multimodal ones):
    one rank's of ``tp_size`` (``num_heads`` and ``num_kv_heads`` divided by it; the caller has
    checked that they divide, :func:`replica.config.model_files.check_tp_size`)."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    num_heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
    return ModelShape(
        num_layers=text.num_hidden_layers,
        num_heads=num_heads // tp_size,
        num_kv_heads=(getattr(text, "num_key_value_heads", None) or num_heads) // tp_size,
        head_dim=head_dim,
        max_position_embeddings=getattr(text, "max_position_embeddings", None),
        sliding_window=_sliding_window(text),
        longrope_short_len=_longrope_short_len(text),
    )


def _longrope_short_len(text_config) -> int | None:
    """``original_max_position_embeddings`` of a longrope rotary embedding (the shortest, where
    layer types have their own), or None. transformers picks the long factors for every position
    of a forward once its largest position reaches that length
    (``modeling_rope_utils.dynamic_rope_update``)."""
    params = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {}
    per_type = bool(params) and all(isinstance(value, dict) for value in params.values())
    lengths = [
        entry.get("original_max_position_embeddings") or getattr(text_config, "original_max_position_embeddings", None)
        for entry in (params.values() if per_type else [params])
        if isinstance(entry, dict) and entry.get("rope_type", entry.get("type")) == "longrope"
    ]
    lengths = [int(length) for length in lengths if length]
    return min(lengths) if lengths else None


def _sliding_window(text_config) -> int | None:
    """The config's ``sliding_window`` where some layer uses it: every layer (Mistral, Phi-3), or
    those that ``layer_types`` names ``"sliding_attention"`` (Gemma 3). Configs that turn it off
    (Qwen2's ``use_sliding_window=False``) set it to None themselves."""
    window = getattr(text_config, "sliding_window", None)
    layer_types = getattr(text_config, "layer_types", None)
    if not window or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    return int(window)


def kv_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one block takes over all layers, K and V: ``2 * L * block_size * H_kv * D * itemsize``."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


class PagedKVCache:
    """K/V tensors for ``num_blocks`` blocks of ``block_size`` tokens in every layer.

    Shapes: ``key_cache[layer]`` and ``value_cache[layer]`` are
    ``[num_blocks * block_size, num_kv_heads, head_dim]``.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        self.key_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.value_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.key_cache + self.value_cache)
