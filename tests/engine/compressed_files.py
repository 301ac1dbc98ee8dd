"""compressed-tensors checkpoints for the tests, written by the ``compressed-tensors`` package as
llm-compressor writes them (``apply_quantization_config``, scales and zero points from each
group's minimum and maximum by the package's ``calculate_qparams``, ``ModelCompressor``'s
``compress_model`` and ``update_config``): a round-to-nearest W4A16, W8A16 or W8A8 copy of a model."""

from __future__ import annotations

from pathlib import Path

import torch


def scheme_args(name: str):
    """``(weights, input_activations, format)`` of a scheme name: ``w4a16`` (int4, symmetric, groups
    of 32), ``w4a16-channel``, ``w4a16-asym`` (groups of 32 with zero points; ``-naive``: stored a
    byte a value, zero points unpacked), ``w8a16`` (int8 per
    channel), ``w8a8`` (int8 per channel, int8 dynamic per-token inputs), ``w8a8-static`` (inputs
    with a static per-tensor scale), ``fp8`` (float8 weights per channel)."""
    from compressed_tensors.quantization import QuantizationArgs

    def ints(bits: int, strategy: str = "channel", group: int | None = None, symmetric: bool = True) -> QuantizationArgs:
        return QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group)

    tokens = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    return {
        "w4a16": (ints(4, "group", 32), None, "pack-quantized"),
        "w4a16-channel": (ints(4), None, "pack-quantized"),
        "w4a16-asym": (ints(4, "group", 32, symmetric=False), None, "pack-quantized"),
        "w4a16-asym-naive": (ints(4, "group", 32, symmetric=False), None, "naive-quantized"),
        "w8a16": (ints(8), None, "pack-quantized"),
        "w8a8": (ints(8), tokens, "int-quantized"),
        "w8a8-static": (ints(8), QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="tensor"), "int-quantized"),
        "fp8": (QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel"), None, "float-quantized"),
    }[name]


def write_compressed(source: str | Path, target: Path, scheme: str, *, scale_dtype: torch.dtype | None = None,
                     group_size: int | None = None, ignore: tuple[str, ...] = ("lm_head",)) -> Path:
    """``source``'s linear layers (but ``ignore``) quantized by ``scheme`` (:func:`scheme_args`),
    with its tokenizer, written to ``target`` as a compressed-tensors checkpoint. Scales are
    computed in float32 and stored in ``scale_dtype`` (the model's bfloat16 where None, as
    llm-compressor stores them for a bf16 model); ``group_size`` replaces a grouped scheme's 32."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM, AutoTokenizer

    weights, inputs, fmt = scheme_args(scheme)
    if group_size is not None:
        weights = weights.model_copy(update={"group_size": group_size})
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs)},
        ignore=list(ignore), format=fmt,
    )
    apply_quantization_config(model, config)
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        weight = module.weight.detach().float()
        if weights.strategy == "group":
            weight = weight.reshape(weight.shape[0], -1, weights.group_size)
            low, high = weight.amin(-1), weight.amax(-1)
        else:
            low, high = weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True)
        scale, zero = calculate_qparams(low, high, weights)
        module.weight_scale.data = scale.to(scale_dtype or module.weight_scale.dtype)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype)
        if inputs is not None and not inputs.dynamic:
            module.input_scale.data = torch.full_like(module.input_scale, 0.02)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(target)
    compressor.update_config(str(target))
    AutoTokenizer.from_pretrained(source).save_pretrained(target)
    return target
