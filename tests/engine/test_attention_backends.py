"""The test device's fast attention backend against the reference backend, on one step that holds
every kind of sequence: decodes (a one-token context, a context ending on a block boundary, a long
one), a fresh prefill chunk and a later chunk of a prompt. On CPU the fast backend is Carpool's
(C++ decode kernel, padded SDPA); on CUDA it is FlashInfer or torch's varlen flash attention
(float32 falls back to the reference path there)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replica.attention.cpu import CpuBackend
from replica.attention.reference import ReferenceBackend
from tests.helpers import TEST_DEVICE

BLOCK = 4
HEADS, KV_HEADS, DIM = 6, 2, 64


def _fast_backend(device: torch.device, dtype: torch.dtype):
    if device.type == "cuda":
        from replica.attention.cuda import CudaBackend

        backend = CudaBackend(BLOCK, device)
        backend.configure(HEADS, KV_HEADS, DIM, dtype)
        return backend
    return CpuBackend(BLOCK, device, compiled=False)


def _step(query_lens: list[int], context_lens: list[int], num_blocks: int) -> tuple:
    """A step's AttentionMetadata with disjoint, shuffled blocks per sequence."""
    from replica.attention.backend import AttentionMetadata

    rng = np.random.default_rng(0)
    q_lens, ctx = np.array(query_lens), np.array(context_lens)
    lens = q_lens + ctx
    widths = -(-lens // BLOCK)
    blocks = rng.permutation(num_blocks - 1)[: widths.sum()] + 1  # block 0 stays spare
    tables = np.zeros((len(lens), widths.max()), dtype=np.int64)
    slots, start = [], 0
    for i, width in enumerate(widths):
        tables[i, :width] = blocks[start : start + width]
        start += width
        for pos in range(ctx[i], lens[i]):
            slots.append(tables[i, pos // BLOCK] * BLOCK + pos % BLOCK)
    query_start = np.concatenate([[0], np.cumsum(q_lens)])
    return AttentionMetadata(query_start, q_lens, ctx, lens, tables, np.array(slots), int(q_lens.sum()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_backend_equals_the_reference_on_a_mixed_step(dtype):
    device = torch.device(TEST_DEVICE)
    # decodes after 1, 7 (a block boundary at 8) and 40 tokens; a fresh 9-token chunk; 6 tokens after 13
    step = _step([1, 1, 1, 9, 6], [1, 7, 40, 0, 13], num_blocks=64)
    g = torch.Generator().manual_seed(1)
    caches = [torch.randn(64 * BLOCK, KV_HEADS, DIM, generator=g).to(device, dtype) for _ in range(2)]
    q = torch.randn(step.num_tokens, HEADS, DIM, generator=g).to(device, dtype)
    k, v = (torch.randn(step.num_tokens, KV_HEADS, DIM, generator=g).to(device, dtype) for _ in range(2))
    outs, written = [], []
    for backend in (ReferenceBackend(BLOCK, device), _fast_backend(device, dtype)):
        key_cache, value_cache = caches[0].clone(), caches[1].clone()
        backend.plan(step)
        outs.append(backend.forward(q, k, v, key_cache, value_cache, DIM**-0.5).float())
        written.append((key_cache, value_cache))
    assert outs[1].shape == (step.num_tokens, HEADS, DIM)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (outs[0] - outs[1]).abs().max().item() < tolerance
    assert all(torch.equal(a, b) for a, b in zip(written[0], written[1]))  # the same K/V stored
