"""Which attention backend a model runner uses: ``EngineConfig.attention_backend`` on a device."""

from __future__ import annotations

import torch

from replica.attention.backend import AttentionBackend
from replica.attention.cpu import CpuBackend
from replica.attention.reference import ReferenceBackend

ATTENTION_BACKENDS = ("auto", "reference", "cpu", "cuda")


def make_backend(
    name: str, device: torch.device, block_size: int, *, compiled: bool, num_heads: int, num_kv_heads: int,
    head_dim: int, dtype: torch.dtype,
) -> AttentionBackend:
    """The backend ``name`` on ``device`` (``"auto"``: ``cpu`` on a CPU, ``cuda`` on CUDA, else
    ``reference``); ``compiled``: whether the decoder runs under torch.compile (the CPU backend's
    decode path differs); the head counts and ``head_dim`` are the model's, ``dtype`` its K/V's.

    Raises:
        ValueError: an unknown name, or a backend for another device than ``device``.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "auto":
        name = device.type if device.type in ("cpu", "cuda") else "reference"
    if name == "reference":
        return ReferenceBackend(block_size, device)
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError("attention_backend 'cpu' needs device 'cpu'")
        return CpuBackend(block_size, device, compiled=compiled)
    if device.type != "cuda":
        raise ValueError("attention_backend 'cuda' needs a CUDA device")
    from replica.attention.cuda import CudaBackend

    backend = CudaBackend(block_size, device)
    backend.configure(num_heads, num_kv_heads, head_dim, dtype)
    return backend
