"""GGUF's quantized blocks of 32 weights along K, each block of one output row with an fp16 scale
``d`` (and, for Q4_1, a minimum ``m``): Q4_0 ``w = d * (q - 8)``, Q4_1 ``w = d * q + m`` (``q`` in
0..15), Q8_0 ``w = d * q`` (``q`` a signed byte); packed for Carpool's kernels
``carpool_cpu::q4_linear`` and ``carpool_cpu::q8_linear`` (``replica/kernels/csrc/cpu_linear_q4.cpp``
and ``cpu_linear_q8.cpp``, where the layouts are drawn).

* :func:`quantize_q8_0` and :func:`quantize_q4_1` make the blocks of a full-precision weight, as
  llama.cpp's reference quantizers do (``--quantization int8|int4``, :mod:`replica.quant.online`).
* :func:`split_gguf_blocks` reads a tensor's raw GGUF blocks (``[N, K / 32 * bytes per block]``
  uint8, as ``gguf.GGUFReader`` gives them) into a :class:`BlockWeight`. The block layouts are
  ggml's (``ggml-common.h``: ``block_q4_0``, ``block_q4_1``, ``block_q8_0``): ``d``, then ``m``
  (Q4_1), then the block's values: for the 4-bit types 16 bytes whose low nibbles are elements
  0..15 and high nibbles 16..31, for Q8_0 32 signed bytes.
* :func:`pack_weight` lays a weight out for its kernel; :func:`dequantize` gives the weights it
  stands for (float32), the reference the kernels are tested against.
* :func:`use_blocks` routes an ``nn.Linear`` through its kernel and releases its dense weight;
  :func:`embed_from_blocks` has a tied input embedding read its rows from the output layer's Q8_0
  blocks.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch

BLOCK = 32  # elements per block, along K
# type name -> (bytes per block, bits per value, offset subtracted from the stored value, has a minimum)
BLOCK_TYPES = {"Q4_0": (18, 4, 8, False), "Q4_1": (20, 4, 0, True), "Q8_0": (34, 8, 128, False)}


@dataclass
class BlockWeight:
    """One linear layer's weight as blocks: ``q`` uint8 ``[N, K]`` (4-bit types: 0..15; Q8_0: the
    signed byte plus 128), ``scales`` and ``mins`` fp16 ``[N, K / 32]`` (``mins`` None but for
    Q4_1), ``offset`` and ``bits``: ``w[n, k] = scales[n, k // 32] * (q[n, k] - offset) +
    mins[n, k // 32]``."""

    q: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    offset: int
    bits: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)


def quantize_q8_0(weight: torch.Tensor) -> BlockWeight:
    """Q8_0 blocks of ``weight`` ``[N, K]`` (K a multiple of 32): for each block of 32, ``d =
    max |w| / 127`` and ``q = round(w / d)`` (halves away from zero), ``d`` stored as fp16; llama.cpp's
    ``quantize_row_q8_0_ref`` (``ggml-quants.c``), computed in float32.

    Raises:
        ValueError: ``weight`` is not 2-D or ``K`` is not a multiple of 32.
    """
    blocks = _blocks_of(weight)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    scaled = blocks * inverse
    q = (scaled.sign() * (scaled.abs() + 0.5).floor()).to(torch.int16)  # roundf: halves away from zero
    n = weight.shape[0]
    return BlockWeight((q + 128).to(torch.uint8).reshape(n, -1), d.squeeze(-1).half(), None, 128, 8)


def quantize_q4_1(weight: torch.Tensor) -> BlockWeight:
    """Q4_1 blocks of ``weight`` ``[N, K]`` (K a multiple of 32): for each block of 32, its minimum
    ``m`` and ``d = (max - m) / 15``, ``q = min(15, trunc((w - m) / d + 0.5))``, ``d`` and ``m`` stored
    as fp16; llama.cpp's ``quantize_row_q4_1_ref`` (``ggml-quants.c``), computed in float32.

    Raises:
        ValueError: ``weight`` is not 2-D or ``K`` is not a multiple of 32.
    """
    blocks = _blocks_of(weight)
    low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    d = (high - low) / 15
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = ((blocks - low) * inverse + 0.5).floor().clamp(max=15).to(torch.uint8)  # the values are >= 0: trunc = floor
    n = weight.shape[0]
    return BlockWeight(q.reshape(n, -1), d.squeeze(-1).half(), low.squeeze(-1).half(), 0, 4)


def _blocks_of(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[N, K]`` as float32 ``[N, K / 32, 32]``."""
    if weight.dim() != 2 or weight.shape[1] % BLOCK:
        raise ValueError(f"a weight of {tuple(weight.shape)} is not rows of whole {BLOCK}-element blocks")
    return weight.detach().float().reshape(weight.shape[0], -1, BLOCK)


def split_gguf_blocks(raw: torch.Tensor, type_name: str) -> BlockWeight:
    """``raw`` uint8 ``[N, K / 32 * bytes per block]`` of a Q4_0, Q4_1 or Q8_0 tensor -> its blocks.

    Raises:
        ValueError: another type, or a row length that is not a whole number of blocks.
    """
    if type_name not in BLOCK_TYPES:
        raise ValueError(f"not a block type Carpool's kernels read: {type_name} (they read {', '.join(BLOCK_TYPES)})")
    size, bits, offset, has_min = BLOCK_TYPES[type_name]
    if raw.dim() != 2 or raw.dtype != torch.uint8 or raw.shape[1] % size:
        raise ValueError(f"{type_name}: rows of {tuple(raw.shape)} {raw.dtype} are not whole {size}-byte blocks")
    n, blocks = raw.shape[0], raw.shape[1] // size
    b = raw.reshape(n, blocks, size)
    scales = b[..., 0:2].contiguous().view(torch.float16).reshape(n, blocks)
    mins = b[..., 2:4].contiguous().view(torch.float16).reshape(n, blocks) if has_min else None
    if bits == 4:
        qs = b[..., size - 16 :]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # elements 0..15, then 16..31
    else:
        q = b[..., 2:].contiguous().view(torch.int8).to(torch.int16).add(offset).to(torch.uint8)
    q = q.reshape(n, blocks * BLOCK).contiguous()
    return BlockWeight(q, scales.contiguous(), mins.contiguous() if mins is not None else None, offset, bits)


def dequantize(weight: BlockWeight) -> torch.Tensor:
    """The float32 weights ``[N, K]`` the blocks stand for (each an exact product of fp16 and a
    small integer, plus the minimum, in float32)."""
    scales = weight.scales.float().repeat_interleave(BLOCK, dim=1)
    w = scales * (weight.q.float() - weight.offset)
    if weight.mins is not None:
        w = w + weight.mins.float().repeat_interleave(BLOCK, dim=1)
    return w


def pack_weight(weight: BlockWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The kernel's layout, for ``G = ceil(N / 16)`` groups of 16 outputs and ``B = K / 32`` blocks:
    ``qweight`` uint8, 4-bit ``[G, B, 8, 16, 2]`` (byte ``[g, b, h, j, e]`` = ``q[16g + j, 32b + 4h
    + e] | q[16g + j, 32b + 4h + 2 + e] << 4``), 8-bit ``[G, B, 16, 16, 2]`` (byte ``[g, b, p, j,
    e]`` = ``q[16g + j, 32b + 2p + e] - 128``, the signed byte GGUF stores); ``scales`` and ``mins`` fp16 ``[G, B, 16]``. Padded
    outputs have zero scales.

    Raises:
        ValueError: ``K`` is not a multiple of 32.
    """
    n, k = weight.q.shape
    if k % BLOCK:
        raise ValueError(f"K = {k} is not a multiple of {BLOCK}")
    pad = (-n) % 16
    q = torch.nn.functional.pad(weight.q, (0, 0, 0, pad))
    groups, blocks = (n + pad) // 16, k // BLOCK
    if weight.bits == 4:
        q = q.reshape(groups, 16, blocks, 8, 2, 2)  # [g, j, b, h, t, e]: k = 32b + 4h + 2t + e
        packed = (q[..., 0, :] | (q[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).contiguous()  # [g, b, h, j, e]
    else:
        signed = q ^ 0x80  # the byte of q - 128 as int8
        packed = signed.reshape(groups, 16, blocks, 16, 2).permute(0, 2, 3, 1, 4).contiguous()  # [g, b, p, j, e]

    def per_group(values: torch.Tensor | None) -> torch.Tensor | None:
        if values is None:
            return None
        values = torch.nn.functional.pad(values, (0, 0, 0, pad))
        return values.reshape(groups, 16, blocks).permute(0, 2, 1).contiguous()

    return packed, per_group(weight.scales), per_group(weight.mins)


def block_linear(x: torch.Tensor, packed: tuple, bias: torch.Tensor | None, out_features: int, offset: int, bits: int) -> torch.Tensor:
    """``x @ W.T + bias`` on a weight from :func:`pack_weight` (``packed``), by its kernel."""
    qweight, scales, mins = packed
    if bits == 4:
        return torch.ops.carpool_cpu.q4_linear(x, qweight, scales, mins, bias, out_features, offset)
    return torch.ops.carpool_cpu.q8_linear(x, qweight, scales, bias, out_features)


def _q4_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.carpool_cpu.q4_linear(
        x, self.carpool_q_weight, self.carpool_q_scales, self.carpool_q_mins, self.bias,
        self.carpool_out_features, self.carpool_q_offset,
    )


def _q8_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.carpool_cpu.q8_linear(x, self.carpool_q_weight, self.carpool_q_scales, self.bias, self.carpool_out_features)


def use_blocks(module: torch.nn.Linear, weight: BlockWeight) -> None:
    """Route ``module`` through its kernel on ``weight`` and release its dense weight (an empty
    tensor of its dtype stays as ``weight``; a weight shared with another module, a tied input
    embedding, stays with that module).

    Raises:
        ValueError: ``weight``'s shape is not the module's ``[out_features, in_features]``.
    """
    if weight.shape != tuple(module.weight.shape):
        raise ValueError(f"quantized weight {weight.shape} does not fit a linear layer of {tuple(module.weight.shape)}")
    module.carpool_q_weight, module.carpool_q_scales, module.carpool_q_mins = pack_weight(weight)
    module.carpool_q_offset = weight.offset
    module.carpool_out_features, module.carpool_in_features = weight.shape
    module.forward = types.MethodType(_q4_forward if weight.bits == 4 else _q8_forward, module)
    module.weight = torch.nn.Parameter(module.weight.data.new_empty(0), requires_grad=False)


def embed_from_blocks(embedding: torch.nn.Module, head: torch.nn.Linear, dtype: torch.dtype) -> bool:
    """Have a plain ``nn.Embedding`` tied to ``head`` read its rows from the head's Q8_0 blocks
    (:func:`_embed_from_blocks`) and release its dense weight; False (nothing changed) where the
    head is not on the 8-bit kernel or the embedding is another module."""
    if getattr(head.forward, "__func__", None) is not _q8_forward or type(embedding) is not torch.nn.Embedding:
        return False
    embedding.carpool_q_rows = (head.carpool_q_weight, head.carpool_q_scales)
    embedding.carpool_dtype = dtype
    embedding.forward = types.MethodType(_embed_from_blocks, embedding)
    embedding.weight = torch.nn.Parameter(embedding.weight.data.new_empty(0), requires_grad=False)
    return True


def _embed_from_blocks(self: torch.nn.Embedding, input_ids: torch.Tensor) -> torch.Tensor:
    """The input embedding of a tied model whose output layer reads Q8_0 blocks, from those blocks:
    token ``t``'s row is output ``t`` of the packed weight (``[G, B, 16, 16, 2]``: group ``t // 16``,
    lane ``t % 16``, its ``B x 32`` signed bytes in ascending k) times its blocks' scales, computed in float32
    and rounded to the model's dtype: the values the blocks stand for. ``input_ids`` ``[...]``
    (ids below V: the engine checks them) -> ``[..., K]``."""
    qweight, scales = self.carpool_q_rows
    group, lane = input_ids // 16, input_ids % 16
    q = qweight[group, :, :, lane, :].reshape(*input_ids.shape, -1, 32).view(torch.int8)  # [..., B, 32]
    d = scales[group, :, lane].float().unsqueeze(-1)  # [..., B, 1]
    return (d * q.float()).reshape(*input_ids.shape, -1).to(self.carpool_dtype)
