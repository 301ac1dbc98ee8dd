"""Weights in blocks along K, as GGUF stores them, packed for Carpool's kernels
``carpool_cpu::q4_linear`` and ``carpool_cpu::q8_linear`` (``replica/kernels/csrc/cpu_linear_q4.cpp``
and ``cpu_linear_q8.cpp``, where the layouts are drawn). Blocks of 32 weights of one output row
with an fp16 scale ``d`` (and, for Q4_1, a minimum ``m``): Q4_0 ``w = d * (q - 8)``, Q4_1 ``w = d *
q + m`` (``q`` in 0..15), Q5_0 ``w = d * (q - 16)`` (``q`` in 0..31: the 4-bit kernel with a plane
of fifth bits; Q5_1 as Q4_1 with 5-bit ``q``), Q8_0 ``w = d * q`` (``q`` a signed byte). GGUF's
K-quants hold an integer scale (and minimum) per sub-block under fp16 ones per super-block of 256:
Q4_K and Q5_K ``w = d * sc * q - dmin * m`` (sub-blocks of 32, ``q`` in 0..15 or 0..31), Q6_K ``w =
d * sc * (q - 32)`` (sub-blocks of 16, ``q`` in 0..63); they run on the same kernels, which
multiply the two scales per block (exact in float32).

* :func:`quantize_q8_0` and :func:`quantize_q4_1` make the blocks of a full-precision weight, as
  llama.cpp's reference quantizers do (``--quantization int8|int4``, :mod:`replica.quant.online`);
  :mod:`replica.quant.gguf_blocks` reads a GGUF file's tensors into blocks.
* :func:`shard_blocks` cuts a tensor-parallel rank's part of a weight's blocks (:func:`part_bounds`).
* :func:`pack_weight` lays a weight out for its kernel; :func:`dequantize` gives the weights it
  stands for (float32), the reference the kernels are tested against.
* :func:`use_blocks` routes an ``nn.Linear`` through its kernel and releases its dense weight;
  :func:`embed_from_blocks` has a tied input embedding read its rows from the output layer's
  8-bit blocks (Q8_0 or Q6_K).
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch

BLOCK = 32  # elements per block, along K


@dataclass
class BlockWeight:
    """One linear layer's weight as blocks: ``q`` uint8 ``[N, K]`` (4-bit types: 0..15; Q5_0:
    0..31; 8-bit: the signed value plus 128), ``offset`` and ``bits`` (4, 5 or 8), and per block
    of 32 ``scales`` and ``mins`` fp16 ``[N, K / 32]`` (``mins`` None but for Q4_1 and Q5_1): ``w[n, k] =
    scales[n, k // 32] * (q[n, k] - offset) + mins[n, k // 32]``.

    K-quants (``super_scales`` given): ``scales`` are integers per sub-block of ``K /
    scales.shape[1]`` values (uint8 for Q4_K and Q5_K, int8 for Q6_K), multiplied by
    ``super_scales`` fp16 ``[N, S]`` (super-blocks of ``K / S`` values, 32 times a power of two:
    GGUF's 256, a checkpoint's group of 32 to 1024); their ``mins`` are uint8 per sub-block of 32
    times ``super_mins`` fp16, subtracted: ``w = S * sc * (q - offset) - M * m``."""

    q: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    offset: int
    bits: int
    super_scales: torch.Tensor | None = None
    super_mins: torch.Tensor | None = None

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


def with_zero_points(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> BlockWeight:
    """4-bit weights ``w = s * (q - z)`` with an fp16 scale ``s`` and an integer zero point ``z`` per
    group of ``group`` inputs (as GPTQ, AWQ and compressed-tensors' asymmetric int4 store them) as
    K-quant blocks, exact in float32: under the group's ``s`` as super-block scale and minimum,
    each block of 32 has the integer scale 1 and the minimum ``z``, so ``w = s * 1 * q - s * z``.
    ``q`` uint8 ``[N, K]`` (0..15), ``scales`` fp16 ``[N, K / group]``, ``zeros`` uint8 ``[N, K /
    group]`` (0..15); super-blocks are the group's largest power-of-two run of blocks.

    Raises:
        ValueError: ``group`` is not a multiple of 32 dividing K.
    """
    n, k = q.shape
    if group % BLOCK or k % group or scales.shape != (n, k // group) or zeros.shape != scales.shape:
        raise ValueError(f"groups of {group} do not fit a weight of {(n, k)} with {tuple(scales.shape)} scales")
    blocks = group // BLOCK
    per_super = blocks & -blocks  # the largest power of two dividing the group's blocks
    supers = scales.half().repeat_interleave(blocks // per_super, dim=1)
    return BlockWeight(q.to(torch.uint8), torch.ones(n, k // BLOCK, dtype=torch.uint8),
                       zeros.to(torch.uint8).repeat_interleave(blocks, dim=1), 0, 4, super_scales=supers, super_mins=supers)


def part_bounds(size: int, index: int, parts: int) -> tuple[int, int]:
    """``(start, length)`` of part ``index`` of ``parts`` along a dimension of ``size``, as
    ``torch.distributed.tensor.Shard`` (and so transformers' tensor-parallel plan) splits it:
    ``torch.chunk``'s parts of ``ceil(size / parts)``, the last ones shorter or empty.

    Raises:
        ValueError: ``index`` is not below ``parts``.
    """
    if not 0 <= index < parts:
        raise ValueError(f"part {index} of {parts} is no part")
    chunk = -(-size // parts)
    start = min(index * chunk, size)
    return start, min(chunk, size - start)


def shard_blocks(weight: BlockWeight, dim: int, index: int, parts: int) -> BlockWeight | None:
    """Part ``index`` of ``parts`` of ``weight`` along ``dim`` (0: output rows, as a column-wise
    tensor-parallel layer holds them; 1: inputs, as a row-wise one does; the parts are
    :func:`part_bounds`'), standing for exactly those rows or columns of the weights; None where
    a part of the inputs does not start and end on whole blocks of 32, or is empty. Rows are
    sliced as they are. Along K a part takes its blocks' values, scales and minimums; a K-quant
    super-block (or a checkpoint's group) that the cut splits has its fp16 scale and minimum
    repeated over smaller super-blocks (the largest of 32 times a power of two that divide the
    part's start and length), the same weights with more scales.

    Raises:
        ValueError: ``dim`` is not 0 or 1, or ``index`` is not below ``parts``.
    """
    if dim not in (0, 1):
        raise ValueError(f"dim {dim} is neither a weight's rows (0) nor its inputs (1)")
    k = weight.shape[1]
    start, length = part_bounds(weight.shape[dim], index, parts)
    if length == 0 or (dim == 1 and (start % BLOCK or length % BLOCK)):
        return None
    if dim == 0:
        rows = slice(start, start + length)
        cut = [t[rows] if t is not None else None for t in (weight.q, weight.scales, weight.mins, weight.super_scales, weight.super_mins)]
        return BlockWeight(cut[0], cut[1], cut[2], weight.offset, weight.bits, cut[3], cut[4])

    def columns(values: torch.Tensor | None) -> torch.Tensor | None:
        if values is None:
            return None
        width = k // values.shape[1]  # inputs per value: a block or sub-block (32 or 16: whole in a part), a super-block
        smaller = width
        while start % smaller or length % smaller:  # a split super-block: 32 times a power of two, so this ends at 32 or above
            smaller //= 2
        values = values.repeat_interleave(width // smaller, dim=1)
        return values[:, start // smaller : (start + length) // smaller]

    return BlockWeight(
        weight.q[:, start : start + length], columns(weight.scales), columns(weight.mins),
        weight.offset, weight.bits, columns(weight.super_scales), columns(weight.super_mins),
    )


def _blocks_of(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[N, K]`` as float32 ``[N, K / 32, 32]``."""
    if weight.dim() != 2 or weight.shape[1] % BLOCK:
        raise ValueError(f"a weight of {tuple(weight.shape)} is not rows of whole {BLOCK}-element blocks")
    return weight.detach().float().reshape(weight.shape[0], -1, BLOCK)


def dequantize(weight: BlockWeight) -> torch.Tensor:
    """The float32 weights ``[N, K]`` the blocks stand for, computed as ggml de-quantizes them
    (each scale, and a K-quant's product of two, exact in float32; times the value, then the
    minimum added or, for K-quants, subtracted)."""
    k = weight.q.shape[1]
    w = _per_value(weight.scales, weight.super_scales, k) * (weight.q.float() - weight.offset)
    if weight.mins is None:
        return w
    mins = _per_value(weight.mins, weight.super_mins, k)
    return w - mins if weight.super_mins is not None else w + mins


def _per_value(values: torch.Tensor, supers: torch.Tensor | None, k: int) -> torch.Tensor:
    """Per-block (or per-sub-block) ``values`` ``[N, B]``, times their super-blocks' ``supers``
    ``[N, S]`` where given, as float32 ``[N, k]``."""
    values = values.float()
    if supers is not None:
        values = values * supers.float().repeat_interleave(values.shape[1] // supers.shape[1], dim=1)
    return values.repeat_interleave(k // values.shape[1], dim=1)


def pack_weight(weight: BlockWeight) -> tuple[torch.Tensor, ...]:
    """The kernel's layout, for ``G = ceil(N / 16)`` groups of 16 outputs and ``B = K / 32`` blocks:
    ``qweight`` uint8, 4-bit ``[G, B, 8, 16, 2]`` (byte ``[g, b, h, j, e]`` = ``q[16g + j, 32b + 4h
    + e] | q[16g + j, 32b + 4h + 2 + e] << 4``, of 5-bit values their low 4 bits), 8-bit ``[G, B,
    16, 16, 2]`` (byte ``[g, b, p, j, e]`` = ``q[16g + j, 32b + 2p + e] - 128``, the signed byte
    GGUF stores); then ``scales``, ``mins``, ``super_scales`` and ``super_mins`` (each None where
    the weight has none) as ``[G, B', 16]`` for their ``[N, B']``, of their dtypes; then, for
    5-bit values, ``qhigh`` int32 ``[G, B, 8, 2]``, bit ``2j + e`` of word ``[g, b, h, t]`` the
    fifth bit of ``q[16g + j, 32b + 4h + 2t + e]`` (else None). Padded outputs have zero scales.

    Raises:
        ValueError: ``K`` is not a multiple of 32.
    """
    n, k = weight.q.shape
    if k % BLOCK:
        raise ValueError(f"K = {k} is not a multiple of {BLOCK}")
    pad = (-n) % 16
    q = torch.nn.functional.pad(weight.q, (0, 0, 0, pad))
    groups, blocks = (n + pad) // 16, k // BLOCK
    high = None
    if weight.bits in (4, 5):
        q = q.reshape(groups, 16, blocks, 8, 2, 2)  # [g, j, b, h, t, e]: k = 32b + 4h + 2t + e
        if weight.bits == 5:
            bits = ((q >> 4) & 1).permute(0, 2, 3, 4, 1, 5).reshape(groups, blocks, 8, 2, 32).to(torch.int64)  # [g, b, h, t, 2j + e]
            words = (bits << torch.arange(32)).sum(-1)
            high = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()
            q = q & 0x0F
        packed = (q[..., 0, :] | (q[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).contiguous()  # [g, b, h, j, e]
    else:
        signed = q ^ 0x80  # the byte of q - 128 as int8
        packed = signed.reshape(groups, 16, blocks, 16, 2).permute(0, 2, 3, 1, 4).contiguous()  # [g, b, p, j, e]

    def per_group(values: torch.Tensor | None) -> torch.Tensor | None:
        if values is None:
            return None
        values = torch.nn.functional.pad(values, (0, 0, 0, pad))
        return values.reshape(groups, 16, -1).permute(0, 2, 1).contiguous()

    return packed, *(per_group(v) for v in (weight.scales, weight.mins, weight.super_scales, weight.super_mins)), high


def block_linear(x: torch.Tensor, packed: tuple, bias: torch.Tensor | None, out_features: int, offset: int, bits: int) -> torch.Tensor:
    """``x @ W.T + bias`` on a weight from :func:`pack_weight` (``packed``), by its kernel."""
    qweight, scales, mins, super_scales, super_mins, high = packed
    if bits in (4, 5):
        return torch.ops.carpool_cpu.q4_linear(x, qweight, scales, mins, bias, out_features, offset, super_scales, super_mins, high)
    return torch.ops.carpool_cpu.q8_linear(x, qweight, scales, bias, out_features, super_scales)


def _q4_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.carpool_cpu.q4_linear(
        x, self.carpool_q_weight, self.carpool_q_scales, self.carpool_q_mins, self.bias,
        self.carpool_out_features, self.carpool_q_offset, self.carpool_q_super_scales, self.carpool_q_super_mins,
        self.carpool_q_high,
    )


def _q8_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.carpool_cpu.q8_linear(
        x, self.carpool_q_weight, self.carpool_q_scales, self.bias, self.carpool_out_features, self.carpool_q_super_scales,
    )


def as_eight_bit(weight: BlockWeight) -> BlockWeight:
    """A Q5_0 weight (5-bit values, no minimums) as 8-bit blocks standing for the same weights
    (each value minus the offset as a signed byte); any other weight as it is."""
    if weight.bits != 5 or weight.mins is not None or weight.super_scales is not None:
        return weight
    return BlockWeight((weight.q.to(torch.int16) - weight.offset + 128).to(torch.uint8), weight.scales, None, 128, 8)


def use_blocks(module: torch.nn.Linear, weight: BlockWeight) -> None:
    """Route ``module`` through its kernel on ``weight`` and release its dense weight (an empty
    tensor of its dtype stays as ``weight``; a weight shared with another module, a tied input
    embedding, stays with that module). Where the build's 5-bit path does not pay (AVX2:
    ``carpool_cpu::q4_planes_pay``), a Q5_0 weight goes to the 8-bit kernel (:func:`as_eight_bit`).

    Raises:
        ValueError: ``weight``'s shape is not the module's ``[out_features, in_features]``.
    """
    if weight.shape != tuple(module.weight.shape):
        raise ValueError(f"quantized weight {weight.shape} does not fit a linear layer of {tuple(module.weight.shape)}")
    if weight.bits == 5 and not torch.ops.carpool_cpu.q4_planes_pay():
        weight = as_eight_bit(weight)
    (module.carpool_q_weight, module.carpool_q_scales, module.carpool_q_mins, module.carpool_q_super_scales,
     module.carpool_q_super_mins, module.carpool_q_high) = pack_weight(weight)
    module.carpool_q_offset = weight.offset
    module.carpool_out_features, module.carpool_in_features = weight.shape
    module.forward = types.MethodType(_q8_forward if weight.bits == 8 else _q4_forward, module)
    module.weight = torch.nn.Parameter(torch.empty(0, dtype=module.weight.dtype), requires_grad=False)


def tied_output(model: torch.nn.Module) -> tuple[bool, bool]:
    """``(shared, tied)`` for ``model``'s output layer: ``shared`` where it is the input
    embedding's very weight; ``tied`` where it is that, or where the config ties them (under
    tensor parallelism the head holds a shard of the rows and the embedding a whole copy)."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    shared = head is not None and embedding is not None and head.weight is embedding.weight
    config = getattr(model, "config", None)
    return shared, shared or (head is not None and config is not None
                              and bool(getattr(config.get_text_config(), "tie_word_embeddings", False)))


def embed_from_blocks(embedding: torch.nn.Module, head: torch.nn.Linear, dtype: torch.dtype) -> bool:
    """Have a plain ``nn.Embedding`` tied to ``head`` read its rows from the head's 8-bit blocks
    (:func:`_embed_from_blocks`) and release its dense weight; False (nothing changed) where the
    head is not on the 8-bit kernel or the embedding is another module."""
    if getattr(head.forward, "__func__", None) is not _q8_forward or type(embedding) is not torch.nn.Embedding:
        return False
    embedding.carpool_q_rows = (head.carpool_q_weight, head.carpool_q_scales, head.carpool_q_super_scales)
    embedding.carpool_dtype = dtype
    embedding.forward = types.MethodType(_embed_from_blocks, embedding)
    embedding.weight = torch.nn.Parameter(embedding.weight.data.new_empty(0), requires_grad=False)
    return True


def _embed_from_blocks(self: torch.nn.Embedding, input_ids: torch.Tensor) -> torch.Tensor:
    """The input embedding of a tied model whose output layer reads 8-bit blocks, from those
    blocks: token ``t``'s row is output ``t`` of the packed weight (``[G, B, 16, 16, 2]``: group ``t
    // 16``, lane ``t % 16``, its ``B x 32`` signed bytes in ascending k) times its blocks' scales
    (Q6_K: each sub-block's int8 scale times its super-block's), computed in float32 and rounded to
    the model's dtype: the values the blocks stand for. ``input_ids`` ``[...]`` (ids below V: the
    engine checks them) -> ``[..., K]``."""
    qweight, scales, supers = self.carpool_q_rows
    group, lane = input_ids // 16, input_ids % 16
    q = qweight[group, :, :, lane, :].reshape(*input_ids.shape, scales.shape[1], -1).view(torch.int8)  # [..., B', K / B']
    d = scales[group, :, lane].float()  # [..., B']
    if supers is not None:
        d = d * supers[group, :, lane].float().repeat_interleave(scales.shape[1] // supers.shape[1], dim=-1)
    return (d.unsqueeze(-1) * q.float()).reshape(*input_ids.shape, -1).to(self.carpool_dtype)
