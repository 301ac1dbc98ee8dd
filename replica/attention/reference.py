"""The reference attention backend, and what the others take from it (:func:`write_kv`,
:func:`gather_context`). How a step's sequences attend through their block tables, per backend:

* :class:`ReferenceBackend` (``attention_backend="reference"``): one SDPA call per sequence over
  its context gathered from the cache. Obviously right and slow; the fast backends are tested
  against it.
* :class:`~replica.attention.cpu.CpuBackend` (the default on CPU): every token of a step,
  decodes and prefill chunks alike, in one call of Carpool's C++ paged decode kernel
  (:mod:`replica.kernels.cpu_kernels`), one query per token. Where the kernel cannot be built:
  decodes in the compiled :func:`~replica.attention.cpu_decode.decode_attention` (inductor fuses
  the block-table gather into the dot products), or without compile in one SDPA call over their
  gathered contexts; and all prefill chunks in one SDPA call over a padded batch whose query and
  key lengths are bucketed (:func:`replica.kernels.shapes.padded_size`) when the step is padded,
  so that the kernels torch builds per shape stay few.
* :class:`~replica.attention.cuda.CudaBackend` (the default on CUDA): FlashInfer's paged
  kernels when ``flashinfer`` is installed, else torch's varlen flash attention.

Every backend writes the step's new K/V first (``index_copy_`` at ``slot_mapping``) and returns
zeros for the padding tokens of a padded step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from replica.attention.backend import AttentionBackend, AttentionMetadata


def write_kv(key_cache, value_cache, key, value, slot_mapping) -> None:
    """Store a step's new K/V ``[T, H_kv, D]`` at ``slot_mapping`` ``[T]`` of the caches ``[slots, H_kv, D]``."""
    key_cache.index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def gather_context(cache: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """Contexts through block tables: ``cache`` ``[slots, H_kv, D]``, ``block_tables`` ``[S, W]``
    → ``[S, H_kv, W * block_size, D]`` (a copy: one contiguous read per block)."""
    num_seqs, width = block_tables.shape
    rows = cache.view(-1, block_size * cache.shape[1] * cache.shape[2]).index_select(0, block_tables.reshape(-1))
    return rows.view(num_seqs, width * block_size, cache.shape[1], cache.shape[2]).transpose(1, 2)






class ReferenceBackend(AttentionBackend):
    """One SDPA call per sequence, over its whole context gathered from the cache (the test oracle)."""

    name = "reference"
    inline_decode = False

    def plan(self, step: AttentionMetadata) -> None:
        self.step = step
        dev = self.device
        self.slot_mapping = torch.as_tensor(step.slot_mapping, device=dev)
        widths = -(-step.seq_lens // self.block_size)
        self.tables = [torch.as_tensor(step.block_tables[i, : widths[i]], device=dev) for i in range(step.num_seqs)]

    def forward(self, query, key, value, key_cache, value_cache, scale):
        step = self.step
        write_kv(key_cache, value_cache, key, value, self.slot_mapping)
        out = query.new_zeros(step.num_tokens, query.shape[1], query.shape[2])
        for i in range(step.num_seqs):
            start, n, ctx = int(step.query_start[i]), int(step.query_lens[i]), int(step.context_lens[i])
            total = ctx + n
            k = gather_context(key_cache, self.tables[i][None], self.block_size)[:, :, :total]
            v = gather_context(value_cache, self.tables[i][None], self.block_size)[:, :, :total]
            q = query[start : start + n].transpose(0, 1)[None]  # [1, H, n, D]
            mask = torch.arange(total, device=q.device)[None, :] <= torch.arange(ctx, total, device=q.device)[:, None]
            o = F.scaled_dot_product_attention(
                q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=True
            )
            out[start : start + n] = o[0].transpose(0, 1)
        return out


