"""4-bit weights on CUDA through torch's own int4 kernel, tinygemm (``aten._weight_int4pack_mm``, the
path torchao's ``int4_weight_only`` and gpt-fast take), for compressed-tensors W4A16 layers on GPUs.

tinygemm computes ``x @ W.T`` with ``W[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n]`` for ``q``
in 0..15 and ``g = k // group_size``, ``scale`` and ``zero`` interleaved as ``[K / group_size, N, 2]``
(the ``scales_and_zeros`` of torch's own tests, ``test_linalg.py``'s ``_group_quantize_tensor``) in
the activations' dtype (bfloat16 on CUDA). A symmetric int4 weight ``w = s * q`` (``q`` in -8..7)
is ``q + 8`` with ``zero = 0``: exact where ``s`` is exact in bfloat16 (a bf16 checkpoint's scales
are). torch packs the values for its kernel: on CUDA from bytes of two values each (``[N, K / 2]``
uint8, the even column in the high nibble), on CPU (``_convert_weight_to_int4pack_for_cpu``, the
same layout of scales, which is how the tests check it here) from ``[N, K]`` int32.

Shapes the kernel takes: ``group_size`` in 32, 64, 128, 256; ``N`` a multiple of 8; ``K`` a
multiple of ``16 * inner_k_tiles`` (``inner_k_tiles`` 8, 4 or 2, the largest that divides).
"""

from __future__ import annotations

import types

import torch

GROUP_SIZES = (32, 64, 128, 256)


def fits(shape: tuple[int, int], group_size: int) -> bool:
    """Whether tinygemm takes a weight of ``shape`` ``[N, K]`` in groups of ``group_size``."""
    n, k = shape
    return group_size in GROUP_SIZES and n % 8 == 0 and k % group_size == 0 and k % 32 == 0


def scales_and_zeros(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """tinygemm's ``[G, N, 2]`` for symmetric weights of per-group ``scale`` ``[N, G]``: each group's
    scale, and a zero of 0, in ``dtype``."""
    scale = scale.to(dtype)
    return torch.stack((scale, torch.zeros_like(scale)), dim=-1).transpose(0, 1).contiguous()


def pack(q: torch.Tensor) -> torch.Tensor:
    """torch's packed layout of signed 4-bit ``q`` ``[N, K]`` (-8..7) on ``q``'s device: CUDA's
    ``_convert_weight_to_int4pack`` from bytes (even column high), or the CPU one from int32."""
    unsigned = (q.to(torch.int32) + 8).contiguous()
    k = q.shape[1]
    tiles = next(t for t in (8, 4, 2) if k % (16 * t) == 0)
    if q.device.type == "cuda":
        pairs = (unsigned[:, ::2] << 4 | unsigned[:, 1::2]).to(torch.uint8)
        return torch.ops.aten._convert_weight_to_int4pack(pairs, tiles)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned, tiles)


def use_tinygemm(module: torch.nn.Linear, q: torch.Tensor, scale: torch.Tensor, group_size: int, dtype: torch.dtype) -> None:
    """Route ``module`` through tinygemm on symmetric int4 ``q`` ``[N, K]`` with ``scale`` ``[N, K /
    group_size]``, activations of ``dtype`` (bfloat16 on CUDA), on ``q``'s device; its dense
    weight, where it has one, is released (an empty tensor of ``dtype`` stays).

    Raises:
        ValueError: the shape or group size is not one the kernel takes (:func:`fits`).
    """
    if not fits(tuple(q.shape), group_size):
        raise ValueError(f"tinygemm does not take a weight of {tuple(q.shape)} in groups of {group_size}")
    module.carpool_int4_weight = pack(q)
    module.carpool_int4_scales = scales_and_zeros(scale, dtype).to(q.device)
    module.carpool_int4_group = group_size
    module.carpool_out_features = q.shape[0]
    module.forward = types.MethodType(_tinygemm_forward, module)
    module.weight = torch.nn.Parameter(torch.empty(0, dtype=dtype, device=q.device), requires_grad=False)


def _tinygemm_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    if rows.device.type == "cuda":
        out = torch.ops.aten._weight_int4pack_mm(rows, self.carpool_int4_weight, self.carpool_int4_group, self.carpool_int4_scales)
    else:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.carpool_int4_weight, self.carpool_int4_group, self.carpool_int4_scales)
    out = out.reshape(*x.shape[:-1], self.carpool_out_features)
    return out if self.bias is None else out + self.bias
