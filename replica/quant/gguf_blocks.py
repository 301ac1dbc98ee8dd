"""GGUF's quantized tensor layouts read into :class:`~replica.quant.blocks.BlockWeight`: each
tensor's raw bytes (``[N, K / elements per block * bytes per block]`` uint8, as
``gguf.GGUFReader`` gives them) split into its values and scales. The layouts are ggml's
(``ggml-common.h``; the ``gguf`` package's ``quants.py`` de-quantizes the same bytes):

* ``block_q4_0`` (18 bytes per 32 values), ``block_q4_1`` (20), ``block_q8_0`` (34): an fp16 scale
  ``d``, then (Q4_1) an fp16 minimum ``m``, then the values: for the 4-bit types 16 bytes whose low
  nibbles are elements 0..15 and high nibbles 16..31, for Q8_0 32 signed bytes.
* ``block_q5_0`` (22 bytes per 32): fp16 ``d``, a little-endian 32-bit word whose bit ``i`` is
  element ``i``'s fifth bit, then the low 4 bits as Q4_0's; ``w = d * (q - 16)``. ``block_q5_1``
  (24): fp16 ``d`` and ``m``, then as Q5_0; ``w = d * q + m``. llama.cpp writes them in place of
  Q4_K and Q5_K for a layer whose K is not a multiple of 256 (and Q8_0 for Q6_K), so the K-quant
  mixes of models such as SmolLM2 (576) and Qwen2.5-0.5B (896) hold them.
* ``block_q4_K`` (144 bytes per super-block of 256): fp16 ``d`` and ``dmin``, 12 bytes holding
  eight 6-bit scales ``sc`` and minimums ``m`` (one per sub-block of 32), then 128 bytes: for
  each 64 values, 32 bytes whose low nibbles are the first 32 and high nibbles the next 32.
  ``w = d * sc * q - dmin * m``.
* ``block_q5_K`` (176 bytes per 256): as Q4_K, with 32 bytes ``qh`` before the low 4 bits: the
  fifth bit of element ``32s + i`` is bit ``s`` of ``qh[i]``; ``q`` in 0..31.
* ``block_q6_K`` (210 bytes per 256): 128 bytes of low nibbles ``ql``, 64 bytes of high 2-bit
  pairs ``qh``, sixteen int8 scales ``sc`` (one per sub-block of 16), fp16 ``d``;
  ``w = d * sc * (q - 32)``, ``q`` in 0..63.
"""

from __future__ import annotations

import torch

from replica.quant.blocks import BlockWeight

SUPER = 256  # elements per K-quant super-block, along K
# type name -> (elements per block, bytes per block)
GGUF_BLOCK_TYPES = {
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
    "Q4_K": (SUPER, 144), "Q5_K": (SUPER, 176), "Q6_K": (SUPER, 210),
}


def split_gguf_blocks(raw: torch.Tensor, type_name: str) -> BlockWeight:
    """``raw`` uint8 ``[N, K / elements * bytes]`` of a tensor of one of :data:`GGUF_BLOCK_TYPES`
    -> its blocks.

    Raises:
        ValueError: another type, or a row length that is not a whole number of blocks.
    """
    if type_name not in GGUF_BLOCK_TYPES:
        raise ValueError(f"not a block type Carpool's kernels read: {type_name} (they read {', '.join(GGUF_BLOCK_TYPES)})")
    elements, size = GGUF_BLOCK_TYPES[type_name]
    if raw.dim() != 2 or raw.dtype != torch.uint8 or raw.shape[1] % size:
        raise ValueError(f"{type_name}: rows of {tuple(raw.shape)} {raw.dtype} are not whole {size}-byte blocks")
    n, blocks = raw.shape[0], raw.shape[1] // size
    b = raw.reshape(n, blocks, size)
    if type_name in ("Q4_K", "Q5_K"):
        return _q4_k(b) if type_name == "Q4_K" else _q5_k(b)
    if type_name == "Q6_K":
        return _q6_k(b)
    scales = _halves(b[..., 0:2])
    if type_name == "Q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).to(torch.int16).add(128).to(torch.uint8)
        return BlockWeight(q.reshape(n, -1).contiguous(), scales, None, 128, 8)
    qs = b[..., size - 16 :]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # elements 0..15, then 16..31
    if type_name in ("Q5_0", "Q5_1"):
        word = b[..., size - 20 : size - 16].to(torch.int64)
        high = (word[..., 0] | word[..., 1] << 8 | word[..., 2] << 16 | word[..., 3] << 24)[..., None] >> torch.arange(32)
        q = (q | ((high & 1).to(torch.uint8) << 4)).reshape(n, -1).contiguous()
        if type_name == "Q5_1":
            return BlockWeight(q, scales, _halves(b[..., 2:4]), 0, 5)
        return BlockWeight(q, scales, None, 16, 5)
    q = q.reshape(n, -1).contiguous()
    if type_name == "Q4_1":
        return BlockWeight(q, scales, _halves(b[..., 2:4]), 0, 4)
    return BlockWeight(q, scales, None, 8, 4)


def _halves(pairs: torch.Tensor) -> torch.Tensor:
    """``[N, S, 2]`` bytes -> ``[N, S]`` fp16 (little-endian)."""
    return pairs.contiguous().view(torch.float16).reshape(pairs.shape[:2]).contiguous()


def _q4_k(b: torch.Tensor) -> BlockWeight:
    """``[N, S, 144]`` super-blocks -> Q4_K's values (0..15) and uint8 ``sc`` and ``m`` ``[N, 8S]``
    under fp16 ``d`` and ``dmin`` ``[N, S]``."""
    n = b.shape[0]
    return _k_weight(b, _k_nibbles(b[..., 16:]).reshape(n, -1), 4)


def _q5_k(b: torch.Tensor) -> BlockWeight:
    """``[N, S, 176]`` super-blocks -> Q5_K's values (0..31), scales and minimums as :func:`_q4_k`."""
    n = b.shape[0]
    high = torch.stack([(b[..., 16:48] >> s) & 1 for s in range(8)], dim=-2)  # [N, S, 8 sub-blocks, 32]
    q = _k_nibbles(b[..., 48:]) | (high << 4)
    return _k_weight(b, q.reshape(n, -1), 5)


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[N, S, 128]`` bytes -> ``[N, S, 8, 32]`` values: per 64, 32 low nibbles, then 32 high."""
    n, supers = qs.shape[:2]
    qs = qs.reshape(n, supers, 4, 1, 32)
    return torch.cat([qs & 0x0F, qs >> 4], dim=-2).reshape(n, supers, 8, 32)


def _k_weight(b: torch.Tensor, q: torch.Tensor, bits: int) -> BlockWeight:
    """Q4_K's or Q5_K's weight from its super-blocks ``b`` (fp16 ``d``, ``dmin``, 12 bytes of 6-bit
    ``sc`` and ``m``: ``gguf.quants.Q4_K.get_scale_min``'s unpacking) and its values ``q`` ``[N, K]``."""
    n, supers = b.shape[:2]
    packed = b[..., 4:16].reshape(n, supers, 3, 4)
    low, high, both = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
    sc = torch.cat([low & 0x3F, (both & 0x0F) | ((low >> 2) & 0x30)], dim=-1)
    m = torch.cat([high & 0x3F, (both >> 4) | ((high >> 2) & 0x30)], dim=-1)
    return BlockWeight(
        q.contiguous(), sc.reshape(n, -1).contiguous(), m.reshape(n, -1).contiguous(), 0, bits,
        super_scales=_halves(b[..., 0:2]), super_mins=_halves(b[..., 2:4]),
    )


def _q6_k(b: torch.Tensor) -> BlockWeight:
    """``[N, S, 210]`` super-blocks -> Q6_K's values (``q - 32`` as Q8_0's stored byte, ``q + 96``)
    and int8 ``sc`` ``[N, 16S]`` under fp16 ``d`` ``[N, S]``: element ``128h + r`` of a super-block
    has its low 4 bits in nibble ``r // 64`` of ``ql[64h + r % 64]`` and its high 2 in bits
    ``2 (r // 32)`` of ``qh[32h + r % 32]`` (``gguf.quants.Q6_K``)."""
    n, supers = b.shape[:2]
    ql = b[..., :128].reshape(n, supers, 2, 1, 64)
    ql = torch.cat([ql & 0x0F, ql >> 4], dim=-2).reshape(n, supers, 2, 128)
    qh = b[..., 128:192].reshape(n, supers, 2, 1, 32)
    qh = torch.cat([(qh >> shift) & 0x03 for shift in (0, 2, 4, 6)], dim=-2).reshape(n, supers, 2, 128)
    q = (ql | (qh << 4)) + 96  # q - 32 + 128
    sc = b[..., 192:208].contiguous().view(torch.int8).reshape(n, -1)
    return BlockWeight(q.reshape(n, -1).contiguous(), sc.contiguous(), None, 128, 8, super_scales=_halves(b[..., 208:210]))
