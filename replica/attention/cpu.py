"""The CPU attention backend: Carpool's C++ kernels for decode rows, torch's flash attention for prefill chunks."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from replica.attention.backend import AttentionBackend, AttentionMetadata
from replica.attention.cpu_decode import decode_attention
from replica.attention.reference import gather_context, write_kv
from replica.kernels import cpu_kernels
from replica.kernels.shapes import padded_size

# A prefill chunk of at most this many (query, key) pairs runs as decode queries on Carpool's CPU
# decode kernel (one query per token, AttentionMetadata.decode_queries) instead of the padded SDPA call;
# a step of decodes and such chunks only stays in the compiled decode graph. Every chunk does: the
# kernel gives each query the same bits however its prompt was split into chunks and whatever
# prefix was cached, where SDPA's result for a token depends on its chunk's query and key lengths
# (in bf16, enough to change greedy tokens). Its cost on long prompts: docs/bench/cpu-speed.md,
# "Every prefill chunk on the decode kernel". Tests set 0 to send every chunk to SDPA.
INLINE_CHUNK_PAIRS = np.iinfo(np.int64).max


def inline_chunks(step: AttentionMetadata, max_pairs: int) -> np.ndarray:
    """``[S]`` bool: the sequences that attend as decode queries: decodes, and prefill chunks of at
    most ``max_pairs`` (query, key) pairs (``query_lens * seq_lens``)."""
    return (step.query_lens == 1) | (step.query_lens * step.seq_lens <= max_pairs)


class CpuBackend(AttentionBackend):
    """Every token as a decode query of Carpool's kernel; without it, decodes on a compiled
    formulation and prefill chunks in one padded SDPA call (module docstring).

    Args:
        compiled: where Carpool's C++ kernel (:mod:`replica.kernels.cpu_kernels`) cannot be built, compile
            :func:`decode_attention` with inductor (else decodes go through SDPA on gathered contexts).
        pad_shapes: bucket the prefill batch's query and key lengths (see :func:`padded_size`); the
            model runner sets it with step padding.
    """

    name = "cpu"
    inline_decode = True  # decode-like steps may trace decode_attention into the compiled layers

    def __init__(
        self, block_size: int, device: torch.device, *, compiled: bool, pad_shapes: bool = False
    ) -> None:
        super().__init__(block_size, device)
        self.compiled = compiled
        self.pad_shapes = pad_shapes
        self.kernel = cpu_kernels.load()
        # Measured with Carpool's decode kernel only (without it, decodes take a slower formulation).
        self.inline_chunk_pairs = INLINE_CHUNK_PAIRS if self.kernel else 0
        use_inductor = compiled and not self.kernel
        self._decode_kernel = torch.compile(decode_attention, dynamic=True) if use_inductor else None

    def plan(self, step: AttentionMetadata) -> None:
        bs = self.block_size
        self.num_tokens = step.num_tokens
        self.slot_mapping = torch.from_numpy(step.slot_mapping)
        inline = inline_chunks(step, self.inline_chunk_pairs)
        decode, prefill = np.flatnonzero(inline), np.flatnonzero(~inline)
        self.decode = None
        self.decode_all = False
        if len(decode):
            tokens, rows, lens = step.decode_queries(decode)
            self.decode_all = len(tokens) == step.num_tokens  # no prefill on SDPA, no padding tokens
            width = int(-(-lens.max() // bs))
            self.decode = (
                torch.from_numpy(tokens),
                torch.from_numpy(np.ascontiguousarray(step.block_tables[rows, :width])),
                torch.from_numpy(lens),
                width,
            )
        self.prefill = self._plan_prefill(step, prefill) if len(prefill) else None

    def _plan_prefill(self, step: AttentionMetadata, seqs: np.ndarray):
        """Index arrays of one padded SDPA call over the prefill chunks ``seqs``."""
        bs = self.block_size
        q_lens, ctx, lens = step.query_lens[seqs], step.context_lens[seqs], step.seq_lens[seqs]
        fresh = not ctx.any()  # every chunk starts its sequence: attend to its own new K/V only
        q_max = int(q_lens.max())
        k_max = q_max if fresh else int(-(-lens.max() // bs) * bs)
        if self.pad_shapes:
            q_max, k_max = padded_size(q_max), padded_size(k_max)
        width = -(-k_max // bs)
        tables = np.zeros((len(seqs), width), dtype=step.block_tables.dtype)
        have = min(width, step.block_tables.shape[1])
        tables[:, :have] = step.block_tables[seqs, :have]
        offsets = np.arange(q_max)
        valid = offsets[None, :] < q_lens[:, None]  # [P, Qmax]
        tokens = (step.query_start[seqs][:, None] + offsets[None, :])[valid]  # packed token of each valid slot
        q_pos = ctx[:, None] + offsets[None, :]  # [P, Qmax]
        k_pos = np.arange(k_max)
        # Fresh chunks need no mask: causal attention over right-padded rows never reaches a pad.
        mask = None if fresh else (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < lens[:, None, None])
        return (
            torch.from_numpy(tokens),
            torch.from_numpy(np.flatnonzero(valid.reshape(-1))),
            torch.from_numpy(tables),
            None if mask is None else torch.from_numpy(mask[:, None]),
            q_max,
            k_max,
        )

    def forward(self, query, key, value, key_cache, value_cache, scale):
        write_kv(key_cache, value_cache, key, value, self.slot_mapping)
        num_heads, head_dim = query.shape[1], query.shape[2]
        if self.prefill is None and self.decode is not None and self.decode_all:
            # Every token is a decode, in order, and none pads the step: no scatter needed.
            _, tables, lens, width = self.decode
            return self._decode(query, key_cache, value_cache, tables, lens, width, scale)
        out = query.new_zeros(self.num_tokens, num_heads, head_dim)
        if self.decode is not None:
            tokens, tables, lens, width = self.decode
            o = self._decode(query.index_select(0, tokens), key_cache, value_cache, tables, lens, width, scale)
            out.index_copy_(0, tokens, o)
        if self.prefill is not None:
            tokens, slots, tables, mask, q_max, k_max = self.prefill
            num_seqs = tables.shape[0]
            q = self._pad(query, tokens, slots, num_seqs, q_max)
            if mask is None:  # fresh chunks: their own new K/V, padded like the queries
                k, v = self._pad(key, tokens, slots, num_seqs, q_max), self._pad(value, tokens, slots, num_seqs, q_max)
            else:
                k = gather_context(key_cache, tables, self.block_size)[:, :, :k_max].to(q.dtype)
                v = gather_context(value_cache, tables, self.block_size)[:, :, :k_max].to(q.dtype)
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
            )
            o = o.transpose(1, 2).reshape(num_seqs * q_max, num_heads, head_dim)
            out.index_copy_(0, tokens, o.index_select(0, slots))
        return out

    @staticmethod
    def _pad(x: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor, num_seqs: int, length: int) -> torch.Tensor:
        """Packed rows ``x[tokens]`` ``[n, heads, D]`` into a zero-padded ``[num_seqs, heads, length, D]``."""
        padded = x.new_zeros(num_seqs * length, x.shape[1], x.shape[2])
        padded.index_copy_(0, slots, x.index_select(0, tokens))
        return padded.view(num_seqs, length, x.shape[1], x.shape[2]).transpose(1, 2)

    def _decode(self, q, key_cache, value_cache, tables, lens, width, scale):
        if cpu_kernels.available():  # K/V are already written: attend only (no new tokens)
            empty = q.new_empty(0, key_cache.shape[1], key_cache.shape[2])
            no_slots = torch.empty(0, dtype=torch.long)
            return torch.ops.carpool_cpu.decode_attention(
                q, empty, empty, key_cache, value_cache, no_slots, tables, lens, self.block_size, scale
            )
        if self._decode_kernel is not None:
            return self._decode_kernel(q, key_cache, value_cache, tables, lens, width * self.block_size, self.block_size, scale)
        return self._decode_sdpa(q, key_cache, value_cache, tables, lens, width, scale)

    def _decode_sdpa(self, q, key_cache, value_cache, tables, lens, width, scale):
        k = gather_context(key_cache, tables, self.block_size)
        v = gather_context(value_cache, tables, self.block_size)
        mask = (torch.arange(width * self.block_size)[None, :] < lens[:, None])[:, None, None, :]
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=True
        )
        return o.squeeze(2)
