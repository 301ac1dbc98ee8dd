"""The CUDA attention backend: well-kept kernel libraries through the same two calls as every
backend (:meth:`CudaBackend.plan` once per step, :meth:`CudaBackend.forward` once per layer).

* **FlashInfer** (``pip install flashinfer-python``), when importable: one
  ``BatchPrefillWithPagedKVCacheWrapper`` planned per step serves every sequence of the step
  (prefill chunks and decodes alike, causal with each query's offset), reading K/V through the
  block tables in place (the cache viewed as ``[num_blocks, block_size, H_kv, D]``, FlashInfer's
  NHD paged layout); decode-only steps use ``BatchDecodeWithPagedKVCacheWrapper``.
* **torch** otherwise: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2 in ATen) over the
  step's packed queries, causal (``window_size=(-1, 0)``: bottom-right aligned, so a chunk or a
  decode attends to its whole context), GQA without repeated heads, ``num_splits=1`` so that a
  sequence's result does not depend on its batch mates. Keys and values are read through the
  block tables in place (``block_table`` + ``seqused_k``) when ``block_size`` is a multiple of
  256 (FlashAttention-2's page size rule); else each layer gathers the step's contexts into one
  packed copy (slot indices planned once per step, on the device). Keyword arguments the
  installed torch's ``varlen_attn`` lacks are worked around (older releases: ``is_causal`` for the
  window, K/V heads repeated for GQA, gathered contexts for paging).
* **float32** (FlashAttention and FlashInfer take fp16/bf16 only), or neither kernel available:
  the reference backend's per-sequence SDPA, so that fp32 fidelity runs on CUDA too.

Metadata goes to the device in one copy per step (the model runner's ``to_device``); nothing here
synchronizes with the host. Not run on this project's CPU machines: ``tests/gpu/device_check.sh``
runs the engine tests on CUDA with this backend.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch

from replica.attention.backend import AttentionBackend, AttentionMetadata, to_device
from replica.attention.reference import ReferenceBackend, write_kv

FLASHINFER_WORKSPACE_BYTES = 128 << 20
FA2_PAGE_MULTIPLE = 256


def flashinfer_available() -> bool:
    """Whether the ``flashinfer`` package imports."""
    try:
        import flashinfer  # noqa: F401
    except Exception:
        return False
    return True


def varlen_parameters() -> set[str] | None:
    """The keyword parameters of the installed ``torch.nn.attention.varlen.varlen_attn``, or
    ``None`` when this torch has none (its signature changed across releases)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return set(inspect.signature(varlen_attn).parameters)


def packed_context_slots(block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seq_k: torch.Tensor,
                         total: int, block_size: int) -> torch.Tensor:
    """The cache slot of every key of every sequence, packed in sequence order: ``[total]``.

    ``block_tables`` ``[S, W]``, ``seq_lens`` ``[S]``, ``cu_seq_k`` ``[S + 1]`` (cumulative
    ``seq_lens``), ``total = sum(seq_lens)`` (a host int, so no synchronization). Device ops only.
    """
    num_seqs = seq_lens.shape[0]
    seq_of = torch.repeat_interleave(torch.arange(num_seqs, device=seq_lens.device), seq_lens, output_size=total)
    pos = torch.arange(total, device=seq_lens.device) - cu_seq_k[seq_of]
    return block_tables[seq_of, pos // block_size].long() * block_size + pos % block_size


class CudaBackend(AttentionBackend):
    """FlashInfer's paged kernels when installed, else torch's varlen flash attention (see the module
    docstring). ``use_flashinfer=None`` picks by availability."""

    name = "cuda"

    def __init__(self, block_size: int, device: torch.device, *, use_flashinfer: bool | None = None) -> None:
        super().__init__(block_size, device)
        self.use_flashinfer = flashinfer_available() if use_flashinfer is None else use_flashinfer
        self.varlen = None if self.use_flashinfer else varlen_parameters()
        self.paged_torch = (
            self.varlen is not None and block_size % FA2_PAGE_MULTIPLE == 0
            and {"seqused_k", "block_table"} <= self.varlen
        )
        self.fallback: ReferenceBackend | None = None
        if self.use_flashinfer:
            import flashinfer

            workspace = torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
            self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        self._shape: tuple[int, int, int, torch.dtype] | None = None  # heads, kv heads, head dim, dtype

    def configure(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        """The model's attention shape (FlashInfer plans with it). Called once by the model runner.
        A float32 model, or a machine with neither kernel, gets the reference path."""
        self._shape = (num_heads, num_kv_heads, head_dim, dtype)
        kernels = self.use_flashinfer or self.varlen is not None
        if dtype not in (torch.float16, torch.bfloat16) or not kernels:
            self.fallback = ReferenceBackend(self.block_size, self.device)

    def plan(self, step: AttentionMetadata) -> None:
        if self.fallback is not None:
            self.fallback.plan(step)
            return
        bs = self.block_size
        self.num_tokens = step.num_tokens
        self.num_real = int(step.query_start[-1])
        self.decode_only = bool((step.query_lens == 1).all())
        self.max_q = int(step.query_lens.max())
        self.max_k = int(step.seq_lens.max())
        cu_k = np.concatenate([[0], np.cumsum(step.seq_lens)]).astype(np.int64)
        self.total_k = int(cu_k[-1])
        (self.slot_mapping, self.cu_q, self.cu_k, self.seq_lens, self.tables) = to_device(
            [step.slot_mapping, step.query_start, cu_k, step.seq_lens, step.block_tables], self.device
        )
        if self.use_flashinfer:
            self._plan_flashinfer(step)
            return
        self.cu_q32, self.cu_k32 = self.cu_q.int(), self.cu_k.int()
        if self.paged_torch:
            self.seq_lens32, self.tables32 = self.seq_lens.int(), self.tables.int()
        else:
            self.context_slots = packed_context_slots(self.tables, self.seq_lens, self.cu_k, self.total_k, bs)

    def _plan_flashinfer(self, step: AttentionMetadata) -> None:
        num_heads, num_kv_heads, head_dim, dtype = self._shape
        bs = self.block_size
        pages = -(-step.seq_lens // bs)
        indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
        indices = np.concatenate([step.block_tables[i, : pages[i]] for i in range(step.num_seqs)]).astype(np.int32)
        last = (step.seq_lens - (pages - 1) * bs).astype(np.int32)
        indptr_d, indices_d, last_d, qo_d = (
            t.int() for t in to_device([indptr.astype(np.int64), indices.astype(np.int64), last.astype(np.int64),
                                        step.query_start], self.device)
        )
        common = dict(num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=bs, q_data_type=dtype, kv_data_type=dtype)
        if self.decode_only:
            self._decode.plan(indptr_d, indices_d, last_d, num_heads, **common)
        else:
            self._prefill.plan(qo_d, indptr_d, indices_d, last_d, num_heads, causal=True, **common)

    def forward(self, query, key, value, key_cache, value_cache, scale):
        if self.fallback is not None:
            return self.fallback.forward(query, key, value, key_cache, value_cache, scale)
        write_kv(key_cache, value_cache, key, value, self.slot_mapping)
        q = query[: self.num_real]
        if self.use_flashinfer:
            paged = (key_cache.view(-1, self.block_size, *key_cache.shape[1:]),
                     value_cache.view(-1, self.block_size, *value_cache.shape[1:]))
            wrapper = self._decode if self.decode_only else self._prefill
            default_scale = q.shape[-1] ** -0.5  # what the wrappers are planned with
            if scale != default_scale:
                q = q * (scale / default_scale)
            out = wrapper.run(q, paged)
        else:
            out = self._torch_varlen(q, key_cache, value_cache, scale)
        if self.num_real == self.num_tokens:
            return out
        return torch.cat([out, out.new_zeros(self.num_tokens - self.num_real, *out.shape[1:])])

    def _torch_varlen(self, q, key_cache, value_cache, scale):
        from torch.nn.attention.varlen import varlen_attn

        params = self.varlen
        common: dict = dict(scale=scale)
        if "window_size" in params:
            common["window_size"] = (-1, 0)
        else:  # older torch: FlashAttention-2's causal mask, bottom-right aligned as well
            common["is_causal"] = True
        if "num_splits" in params:
            common["num_splits"] = 1
        gqa = "enable_gqa" in params
        if gqa:
            common["enable_gqa"] = True
        if self.paged_torch:
            pages_k = key_cache.view(-1, self.block_size, *key_cache.shape[1:])
            pages_v = value_cache.view(-1, self.block_size, *value_cache.shape[1:])
            return varlen_attn(
                q, pages_k, pages_v, self.cu_q32, None, self.max_q, self.max_k,
                seqused_k=self.seq_lens32, block_table=self.tables32, **common,
            )
        k = key_cache.index_select(0, self.context_slots)
        v = value_cache.index_select(0, self.context_slots)
        if not gqa and k.shape[1] != q.shape[1]:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return varlen_attn(q, k, v, self.cu_q32, self.cu_k32, self.max_q, self.max_k, **common)
