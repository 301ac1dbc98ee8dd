"""Our paged attention, plugged into transformers models through ``AttentionInterface``.

The model runner packs every scheduled token of every request into one row (batch size 1,
``num_tokens`` positions) and passes an :class:`AttentionMetadata` through the model call's
``**kwargs`` (key ``carpool_metadata``); transformers forwards it to every attention layer. No
global state: two engines in one process never see each other's metadata.

Per layer, :func:`paged_attention_forward`:
1. writes the step's new K/V into the paged cache at ``slot_mapping``;
2. decodes (one query token per sequence) attend together: their contexts are gathered through
   their block tables into one padded batch with a length mask, one SDPA call;
3. prefill chunks attend one sequence at a time: a chunk that starts at position 0 attends to its
   own K/V with a causal mask (no gather); a later chunk gathers its earlier context from the
   cache and uses a causal mask shifted by its start position.

This is PagedAttention's memory layout (Kwon et al. 2023, arXiv:2309.06180) computed with
``torch.nn.functional.scaled_dot_product_attention``; GQA heads are not repeated
(``enable_gqa=True``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from replica.kv_cache import PagedKVCache

ATTENTION_NAME = "carpool_paged"


@dataclass
class PrefillChunk:
    """One sequence's prefill chunk: packed tokens ``[token_start, token_end)`` at positions
    ``[context_start, context_start + token_end - token_start)``."""

    token_start: int
    token_end: int
    context_start: int
    block_table: torch.Tensor | None = None  # [1, num_blocks] when context_start > 0
    mask: torch.Tensor | None = None  # [1, 1, q_len, num_blocks * block_size] bool


@dataclass
class AttentionMetadata:
    """What every attention layer needs for one step (built once per step by the model runner).

    Shapes: ``slot_mapping`` ``[num_tokens]``; ``decode_token_indices`` ``[num_decodes]``;
    ``decode_block_tables`` ``[num_decodes, max_blocks]``; ``decode_mask``
    ``[num_decodes, 1, 1, max_blocks * block_size]`` (True = attend).
    """

    kv_cache: PagedKVCache
    slot_mapping: torch.Tensor
    num_tokens: int
    decode_token_indices: torch.Tensor | None = None
    decode_block_tables: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)


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
        query: ``[1, num_heads, num_tokens, head_dim]`` (RoPE applied).
        key, value: ``[1, num_kv_heads, num_tokens, head_dim]`` (GQA heads not repeated).
        kwargs: must hold ``carpool_metadata`` (:class:`AttentionMetadata`).
    Returns:
        ``([1, num_tokens, num_heads, head_dim], None)``.
    Raises:
        NotImplementedError: for attention variants this kernel does not implement
            (logit soft-capping, attention sinks, a sliding window).
    """
    meta: AttentionMetadata | None = kwargs.get("carpool_metadata")
    if meta is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention needs carpool_metadata (run it through ModelRunner)")
    for unsupported in ("softcap", "s_aux", "sliding_window"):
        if kwargs.get(unsupported) is not None:
            raise NotImplementedError(f"{ATTENTION_NAME} does not support {unsupported}")
    layer = module.layer_idx
    cache = meta.kv_cache
    num_heads, head_dim = query.shape[1], query.shape[3]

    new_keys = key[0].transpose(0, 1)  # [T, H_kv, D]
    new_values = value[0].transpose(0, 1)
    cache.write(layer, new_keys, new_values, meta.slot_mapping)

    # Zeros: the rows of a step's padding tokens (no chunk and no decode covers them) stay 0.
    out = query.new_zeros(meta.num_tokens, num_heads, head_dim)
    if meta.decode_token_indices is not None:
        q = query[0].index_select(1, meta.decode_token_indices).transpose(0, 1).unsqueeze(2)
        k, v = cache.gather(layer, meta.decode_block_tables)
        o = F.scaled_dot_product_attention(
            q, k.to(q.dtype), v.to(q.dtype), attn_mask=meta.decode_mask, scale=scaling, enable_gqa=True
        )  # [S_d, H, 1, D]
        out.index_copy_(0, meta.decode_token_indices, o.squeeze(2))
    for chunk in meta.prefills:
        s, e = chunk.token_start, chunk.token_end
        q = query[:, :, s:e]
        if chunk.block_table is None:
            o = F.scaled_dot_product_attention(
                q, key[:, :, s:e], value[:, :, s:e], is_causal=True, scale=scaling, enable_gqa=True
            )
        else:
            k, v = cache.gather(layer, chunk.block_table)
            o = F.scaled_dot_product_attention(
                q, k.to(q.dtype), v.to(q.dtype), attn_mask=chunk.mask, scale=scaling, enable_gqa=True
            )
        out[s:e] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None


def register_paged_attention() -> str:
    """Register :func:`paged_attention_forward` with transformers (idempotent); returns its name."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    return ATTENTION_NAME
