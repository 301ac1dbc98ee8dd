"""Compute a compressed-tensors checkpoint's linear layers from its integer weights
(``quantization: compressed-tensors``, vLLM's name; inferred from the checkpoint's
``quantization_config`` as vLLM infers it).

transformers loads such a checkpoint with the ``compressed-tensors`` package's quantizer: each
quantized ``nn.Linear`` holds its integers as stored (``weight_packed`` int32 for the
``pack-quantized`` format, an int8 ``weight`` for ``int-quantized`` and ``naive-quantized``), its
``weight_scale`` and, where asymmetric, ``weight_zero_point``, and the package would de-quantize
every layer on the model's first forward. :func:`quantize_from_compressed` reads each layer's
integers with the package's own unpacking and puts them on Carpool's block kernels
(:mod:`replica.quant.blocks`) as the weights ``w = s * (q - z)`` the package de-quantizes:

* int4, symmetric (W4A16): the 4-bit kernel, ``q + 8`` as nibbles, offset 8 (GGUF's Q4_0 form),
  ``s`` per block of 32; asymmetric: ``q + 8`` and ``z + 8`` in the K-quant form of
  :func:`replica.quant.blocks.with_zero_points` (``s`` per group as super-block scale and
  minimum; exact).
* int8, symmetric (W8A16; W8A8's weights): the 8-bit kernel (Q8_0's form), ``s`` per block.
* W8A8 (int8 weights, input activations int8, dynamic, per token, symmetric): each token's
  input is quantized by the package's rule (:func:`quantize_tokens`), its integers computed on
  the 8-bit kernel, the output multiplied by the token's scale.

On CUDA (bfloat16), symmetric int4 layers run on torch's int4 kernel instead (tinygemm:
:mod:`replica.quant.tinygemm`, scales exact in bfloat16, groups of 32 to 256); every other layer is
de-quantized there.

Scales are per output channel or per group of ``group_size`` inputs (a multiple of 32). A layer
the kernels cannot compute exactly (a scale that fp16 does not hold exactly, such as most
float32 scales; groups of fewer than 32 inputs; K not whole blocks; int8
with zero points) is de-quantized by the package (``decompress_module``) into a plain dense layer
(W8A8's inputs still quantized per token) and computes what it would in transformers; the log
counts those. A non-finite weight scale refuses the start, naming the layer. Schemes that are
not integer weights of 4 or 8 bits (FP8, NVFP4, MXFP4, ...), static or non-token activation
quantization, output activation or KV-cache quantization and transforms are refused before the
model loads, naming the config group and its targets (:mod:`replica.quant.checkpoint`). Each
packed layer's weights are checked against the package's own de-quantization (float32, equal),
so a wrong unpacking fails the start, not the tokens.

Under tensor parallelism each rank reads every quantized layer whole
(:mod:`replica.quant.compressed_load`), checks it whole, and keeps its part: of the blocks, or
where that part is not whole blocks (or a row-wise layer's columns are in GPTQ's activation
order) of the weights the blocks stand for, dense. W8A8 runs at ``tensor_parallel_size`` 1.
"""

from __future__ import annotations

import logging
import types

import torch

from replica.quant.blocks import BLOCK, BlockWeight, dequantize, part_bounds, shard_blocks, use_blocks, with_zero_points
from replica.quant.checkpoint import NAME

logger = logging.getLogger(__name__)


def compressed_config(model: torch.nn.Module):
    """``model``'s compressed-tensors quantization config (transformers' ``CompressedTensorsConfig``),
    or None where it has none."""
    config = getattr(getattr(model, "config", None), "quantization_config", None)
    method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", None)
    return config if str(getattr(method, "value", method)) == NAME else None


def quantize_from_compressed(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Route each quantized linear layer of ``model`` (loaded by transformers from a compressed-tensors
    checkpoint, still compressed) through its block kernel, or de-quantize it where the kernels
    cannot compute it exactly (see the module's docstring); returns how many are on the kernels.

    The checkpoint's config passed :func:`replica.quant.checkpoint.check_checkpoint` (the model
    runner checks it before loading): its schemes are ones Carpool computes.

    Under tensor parallelism each layer holds its compressed tensors whole
    (:func:`replica.quant.compressed_load.load_whole_compressed`) and its part (``carpool_tp_part``, set by
    :func:`replica.worker.parallel.localize`): it is checked whole and keeps that part of its
    blocks (:func:`~replica.quant.blocks.shard_blocks`; tinygemm: of its integers and scales), or,
    where the part is not whole blocks (or groups) or a row-wise layer's columns are in GPTQ's
    activation order, of the weights its blocks stand for, dense; a layer the kernels would not
    compute exactly keeps its part of the package's de-quantization.

    Raises:
        ValueError: a quantized layer is not linear (an embedding its config group names in a way
            the check before loading does not match) or has a non-finite weight scale (each
            message names the layer); a packed layer disagrees with the package's de-quantization;
            under tensor parallelism, a layer of a style Carpool does not cut (packed rows).
    """
    layers = [(name, module) for name, module in model.named_modules() if getattr(module, "quantization_scheme", None) is not None]
    for name, module in layers:
        if not isinstance(module, torch.nn.Linear):
            raise ValueError(f"quantization {NAME}: layer {name} is a {type(module).__name__}; only linear layers are served quantized")
        if getattr(module, "carpool_tp_part", (0,))[0] is None:
            raise ValueError(f"quantization {NAME}: layer {name}'s tensor-parallel style is neither column- nor row-wise; "
                             "serve the checkpoint at tensor_parallel_size 1")
        _check_finite(name, module)
    count = 0
    cuda = any(module.weight_scale.device.type == "cuda" for _, module in layers)
    for name, module in layers:
        if _to_tinygemm(module, dtype) if cuda else _to_blocks(name, module, dtype):
            count += 1
        elif hasattr(module, "quantization_scheme"):  # not de-quantized from its blocks already
            _to_dense(module)
            _keep_part(module)
    _remove_decompress_hook(model)
    logger.info("quantization %s: %d linear layers on %s, %d de-quantized (not exact there, or this rank's part not whole blocks)",
                NAME, count, "tinygemm (CUDA)" if cuda else "block kernels", len(layers) - count)
    return count


def _to_blocks(name: str, module: torch.nn.Linear, dtype: torch.dtype) -> bool:
    """Route ``module`` through its block kernel where its blocks are exact; False (nothing changed) if not."""
    integers = _integers(module)
    blocks = _blocks_of(module, *integers)
    if blocks is None:
        return False
    _check_blocks(name, module, blocks, *integers)
    part = getattr(module, "carpool_tp_part", None)
    if part is not None:
        ordered = getattr(module, "carpool_input_order", None) is not None
        whole, blocks = blocks, None if ordered and part[0] == 1 else shard_blocks(blocks, *part)
        if blocks is None:
            _dense_part(module, whole, dtype)
            return False
    activations = module.quantization_scheme.input_activations
    _release_compressed(module, dtype, blocks.shape)
    use_blocks(module, blocks)
    if activations is not None:
        module.carpool_input_args = activations
        module.forward = types.MethodType(_w8a8_forward, module)
    if getattr(module, "carpool_input_order", None) is not None:  # GPTQ in activation order
        module.carpool_ordered_forward = module.forward
        module.forward = types.MethodType(_ordered_forward, module)
    return True


def _to_tinygemm(module: torch.nn.Linear, dtype: torch.dtype) -> bool:
    """Route a symmetric int4 ``module`` (bfloat16 activations, scales exact in bfloat16, a shape
    tinygemm takes) through tinygemm on its device; False (nothing changed) for any other layer."""
    from replica.quant.tinygemm import fits, use_tinygemm

    weights = module.quantization_scheme.weights
    if weights.num_bits != 4 or dtype != torch.bfloat16 or getattr(module, "carpool_input_order", None) is not None:
        return False
    q, scale, zero = _integers(module)
    group = q.shape[1] if scale.shape[-1] == 1 else weights.group_size
    part = getattr(module, "carpool_tp_part", None)
    if part is not None and zero is None:
        cut = _integer_part(q, scale, part)
        if cut is None:
            return False
        q, scale = cut
        group = q.shape[1] if scale.shape[-1] == 1 else group
    if zero is not None or not fits(tuple(q.shape), group) or not torch.equal(scale.bfloat16().float(), scale.float()):
        return False
    _release_compressed(module, dtype, tuple(q.shape))
    use_tinygemm(module, q, scale, group, dtype)
    return True


def decompress_all(model: torch.nn.Module) -> None:
    """De-quantize every compressed layer of ``model`` now (:func:`_to_dense`; under tensor
    parallelism each keeps its rank's part), where no kernel serves it (another dtype, a CPU
    without the kernels), and remove the package's first-forward hook."""
    for name, module in model.named_modules():
        if getattr(module, "quantization_scheme", None) is not None:
            _check_finite(name, module)
            _to_dense(module)
            _keep_part(module)
    _remove_decompress_hook(model)


def _check_finite(name: str, module: torch.nn.Module) -> None:
    """Raises ``ValueError`` where a layer's weight scales hold a NaN or an infinity (its weights
    would be NaN: served, every token would be)."""
    if not bool(module.weight_scale.isfinite().all()):
        raise ValueError(f"quantization {NAME}: layer {name} has a weight scale that is not finite (NaN or infinite)")


def _to_dense(module: torch.nn.Module) -> None:
    """De-quantize ``module`` with the package (``decompress_module``, its weights in the scales'
    dtype) into a plain layer, the package's own state and forward removed (they do not compile:
    its forward patches attributes); a layer with int8 inputs (W8A8) keeps them
    (:func:`_w8a8_dense_forward`), and the prepacking leaves its forward alone."""
    from compressed_tensors.compressors.base import decompress_module

    inputs = module.quantization_scheme.input_activations
    decompress_module(module, leave_decompressed=False)
    module.__dict__.pop("forward", None)
    order = module.__dict__.pop("carpool_input_order", None)
    if order is not None:  # columns back in the inputs' order
        module.weight.data = module.weight.data[:, torch.argsort(order)].contiguous()
    if inputs is not None:
        module.carpool_own_forward = True
        module.forward = types.MethodType(_w8a8_dense_forward, module)


def _dense_part(module: torch.nn.Linear, blocks: BlockWeight, dtype: torch.dtype) -> None:
    """A layer whose rank's part is not whole blocks, or whose columns are not its inputs' order
    (GPTQ's activation order, row-wise): its part (:func:`_keep_part`) of the weights its whole
    ``blocks`` stand for (exact in float32, columns in the inputs' order), dense in ``dtype``."""
    weight = dequantize(blocks)
    order = module.__dict__.pop("carpool_input_order", None)
    if order is not None:
        weight = weight[:, torch.argsort(order)]
    _release_compressed(module, dtype, blocks.shape)
    module.weight = torch.nn.Parameter(weight.to(dtype), requires_grad=False)
    _keep_part(module)


def _keep_part(module: torch.nn.Linear) -> None:
    """A de-quantized layer under tensor parallelism keeps its part of the weight
    (``carpool_tp_part``: rows or inputs)."""
    part = getattr(module, "carpool_tp_part", None)
    if part is not None:
        dim, index, parts = part
        bounds = part_bounds(module.weight.shape[dim], index, parts)
        module.weight = torch.nn.Parameter(module.weight.data.narrow(dim, *bounds).contiguous(), requires_grad=False)


def _integer_part(q: torch.Tensor, scale: torch.Tensor, part: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A rank's part (``(dim, index, parts)``) of symmetric integers ``q`` ``[N, K]`` and their
    scales ``[N, G]``: rows, or inputs with their groups' scales (a per-channel scale whole);
    None where the part splits a group."""
    dim, index, parts = part
    start, length = part_bounds(q.shape[dim], index, parts)
    if dim == 0:
        return q.narrow(0, start, length), scale.narrow(0, start, length)
    group = q.shape[1] // scale.shape[1]
    if scale.shape[1] > 1 and (start % group or length % group):
        return None
    scale = scale if scale.shape[1] == 1 else scale[:, start // group : (start + length) // group]
    return q.narrow(1, start, length), scale


def _integers(module: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(q, s, z)``: the layer's integer weights int16 ``[N, K]``, its scales ``[N, G]`` (G = 1
    per channel, K / group_size per group) as stored and its zero points int16 ``[N, G]`` (None
    where symmetric), read with the package's own unpacking."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    weights = module.quantization_scheme.weights
    scale = module.weight_scale.detach()
    if hasattr(module, "weight_packed"):
        shape = torch.Size(module.weight_shape.tolist())
        q = unpack_from_int32(module.weight_packed.detach(), weights.num_bits, shape)
        zero = getattr(module, "weight_zero_point", None)
        if zero is not None and not weights.symmetric:
            zero = unpack_from_int32(zero.detach(), weights.num_bits, (shape[0], scale.shape[-1]), packed_dim=0)
    else:
        q = module.weight.detach()
        zero = getattr(module, "weight_zero_point", None)
    if weights.symmetric or zero is None:
        zero = None
    else:
        zero = zero.detach().reshape(scale.shape).to(torch.int16)
    return q.to(torch.int16), scale, zero


def _blocks_of(module: torch.nn.Linear, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> BlockWeight | None:
    """The layer's weights (its :func:`_integers` ``q``, ``scale``, ``zero``) as blocks for the
    kernels, or None where they would not be exact."""
    weights = module.quantization_scheme.weights
    n, k = q.shape
    group = k if scale.shape[-1] == 1 else weights.group_size
    if k % BLOCK or group % BLOCK or scale.shape != (n, k // group):
        return None
    half = scale.half()
    if not (half.isfinite().all() and torch.equal(half.float(), scale.float())):
        return None
    per_block = half.repeat_interleave(group // BLOCK, dim=1)  # [N, K / 32]
    if weights.num_bits == 8:
        return None if zero is not None else BlockWeight((q + 128).to(torch.uint8), per_block, None, 128, 8)
    if zero is None:
        return BlockWeight((q + 8).to(torch.uint8), per_block, None, 8, 4)
    return with_zero_points((q + 8).to(torch.uint8), half, (zero + 8).to(torch.uint8), group)  # s * ((q + 8) - (z + 8))


def _check_blocks(name: str, module: torch.nn.Linear, blocks: BlockWeight, q: torch.Tensor, scale: torch.Tensor,
                  zero: torch.Tensor | None) -> None:
    """Raises ``ValueError`` where ``blocks`` do not stand for the weights the package de-quantizes
    from the layer's integers (:func:`_integers`)."""
    from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize

    expected = ct_dequantize(q.to(torch.int8), scale.float(), None if zero is None else zero.to(torch.int8),
                             module.quantization_scheme.weights, dtype=torch.float32)
    if not torch.equal(dequantize(blocks), expected):
        raise ValueError(f"quantization {NAME}: layer {name}'s blocks do not match the package's de-quantization")


def _release_compressed(module: torch.nn.Linear, dtype: torch.dtype, shape: tuple[int, int]) -> None:
    """Drop the layer's compressed tensors and the package's state; a placeholder ``weight`` of
    ``shape`` (the weight it computes: this rank's part under tensor parallelism; on ``meta``) and
    ``dtype`` stays for :func:`use_blocks` to release."""
    for key in ("weight", "weight_packed", "weight_scale", "weight_zero_point", "weight_shape",
                "input_scale", "input_zero_point"):
        if key in module._parameters or key in module._buffers:
            delattr(module, key)
    for key in ("quantization_scheme", "quantization_status", "quantization_enabled"):
        module.__dict__.pop(key, None)
    module.__dict__.pop("forward", None)
    module.weight = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=False)


def _remove_decompress_hook(model: torch.nn.Module) -> None:
    """Remove the package's first-forward decompression hook (every layer is served already)."""
    from compressed_tensors.compressors import ModelCompressor

    ModelCompressor.from_compression_config(compressed_config(model)).remove_decompression_hook(model)


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``x`` ``[..., K]`` quantized to int8 as compressed-tensors quantizes dynamic,
    per-token, symmetric int8 activations (``calculate_qparams`` and ``_quantize``, computed in
    ``x``'s dtype): ``s = max |x| / 127.5`` (0 becomes the dtype's epsilon), ``q = round(clamp(x /
    s, -128, 127))``. Returns ``(q, s)``: ``q`` ``[..., K]`` integer-valued in ``x``'s dtype, ``s``
    ``[..., 1]``. Written out rather than called from the package, whose helpers (a cached range
    per device, strategy dispatch) compile three times slower and warn under torch.compile; the
    tests hold it to the package's output bit for bit."""
    scale = x.abs().amax(-1, keepdim=True) / 127.5
    scale = torch.where(scale == 0, torch.finfo(x.dtype).eps, scale)
    return torch.round(torch.clamp(x / scale, -128, 127)), scale


def _ordered_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A layer whose columns are its inputs in ``carpool_input_order`` (GPTQ in activation order):
    its kernel on ``x[..., order]``."""
    return self.carpool_ordered_forward(x.index_select(-1, self.carpool_input_order))


def _w8a8_dense_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A de-quantized W8A8 layer, as the package computes it: each token's input quantized
    (:func:`quantize_tokens`) and de-quantized in ``x``'s dtype, times the dense weight."""
    q, scale = quantize_tokens(x)
    return torch.nn.functional.linear(q * scale, self.weight, self.bias)


def _w8a8_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """W8A8: each token's input quantized to int8 (:func:`quantize_tokens`), ``q @ W.T`` on the
    8-bit kernel (exact integers in ``x``'s dtype, summed in float32), times the token's scale,
    plus the bias."""
    q, scale = quantize_tokens(x)
    out = torch.ops.carpool_cpu.q8_linear(
        q, self.carpool_q_weight, self.carpool_q_scales, None, self.carpool_out_features, self.carpool_q_super_scales,
    )
    out = (out.float() * scale.float()).to(x.dtype)
    return out if self.bias is None else out + self.bias
