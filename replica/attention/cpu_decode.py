"""Decode attention (one query token per sequence, or per token of a prefill chunk, each seeing
its sequence up to itself) read through block tables, for the decode-like steps whose attention is
traced into the compiled decoder layers (``replica.attention.backend.DecodeStep``) and for the CPU
backend's fallback.

:func:`decode_step_attention` uses Carpool's CPU kernel when it is built
(:mod:`replica.kernels.cpu_kernels`), else :func:`decode_attention`, a formulation in torch ops that
inductor fuses (the block-table gather becomes indexed loads inside the dot products).
"""

from __future__ import annotations

import torch

from replica.kernels import cpu_kernels


def decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_len: int,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence, attending to its first ``seq_lens[i]`` cached tokens.

    Written as broadcasts and reductions that read K/V through the block table by index, so that
    under torch.compile the gather fuses into the dot products (no context is copied). Eager, it
    would materialize ``[S, max_len, H_kv, G, D]`` intermediates: call it compiled.

    Args:
        query: ``[S, H, D]``; ``key_cache``/``value_cache``: ``[slots, H_kv, D]``;
        block_tables: ``[S, W]`` with ``W * block_size >= max_len``; seq_lens: ``[S]``.
        max_len: tokens to scan per sequence (at least ``max(seq_lens)``).
    Returns:
        ``[S, H, D]`` in ``query``'s dtype; softmax and sums in float32.
    """
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[1]
    group = num_heads // num_kv_heads
    pos = torch.arange(max_len, device=query.device)
    slots = block_tables[:, pos // block_size].long() * block_size + pos % block_size  # [S, L]
    k = key_cache[slots].float().unsqueeze(3)  # [S, L, H_kv, 1, D]
    v = value_cache[slots].float().unsqueeze(3)
    q = query.float().view(num_seqs, 1, num_kv_heads, group, head_dim)
    scores = (q * k).sum(-1) * scale  # [S, L, H_kv, G]
    scores = scores.masked_fill(pos.view(1, -1, 1, 1) >= seq_lens.view(-1, 1, 1, 1), float("-inf"))
    probs = torch.softmax(scores, dim=1)
    out = (probs.unsqueeze(-1) * v).sum(1)  # [S, H_kv, G, D]
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def decode_step_attention(query, key, value, key_cache, value_cache, decode, scale: float) -> torch.Tensor:
    """A decode-only step's attention, traced into the compiled layers (see ``DecodeStep``):
    Carpool's CPU kernel when it is built (:mod:`replica.kernels.cpu_kernels`; it writes the new K/V
    itself) on CPU, else the cache write and :func:`decode_attention` (fused by inductor; on CUDA,
    in the decode steps that :mod:`replica.worker.cuda_graphs` replays)."""
    if cpu_kernels.available() and query.device.type == "cpu":
        return torch.ops.carpool_cpu.decode_attention(
            query, key, value, key_cache, value_cache, decode.slot_mapping, decode.block_tables,
            decode.seq_lens, decode.block_size, scale,
        )
    key_cache[decode.slot_mapping] = key.to(key_cache.dtype)
    value_cache[decode.slot_mapping] = value.to(value_cache.dtype)
    width = decode.block_tables.shape[1]
    return decode_attention(
        query, key_cache, value_cache, decode.block_tables, decode.seq_lens, width * decode.block_size,
        decode.block_size, scale,
    )
