"""What Carpool reads itself from a compressed-tensors checkpoint's files (safetensors), beside
what transformers loads: the tensors transformers leaves out of a layer
(:func:`load_what_transformers_drops`), and under tensor parallelism every quantized layer's
compressed tensors whole (:func:`load_whole_compressed`), which :mod:`replica.quant.compressed`
then computes.
"""

from __future__ import annotations

import logging

import torch

from replica.quant.checkpoint import NAME

logger = logging.getLogger(__name__)


def load_what_transformers_drops(model: torch.nn.Module, path: str, mismatched, unexpected) -> None:
    """Set from the files of the checkpoint at ``path`` (a folder) what transformers' loading
    info (``mismatched_keys``: ``(name, checkpoint shape, model shape)``; ``unexpected_keys``)
    says it left out:

    * packed zero points of asymmetric ``pack-quantized`` layers: transformers 5.25 with
      compressed-tensors 0.20.1 builds them at the unpacked shape ``[N, G]`` (the package's
      compression of a model on ``meta`` leaves them unpacked), so the checkpoint's ``[N / 8, G]``
      int32 ones mismatch (the model is loaded with ``ignore_mismatched_sizes``); set as stored,
      as the package's own decompression reads them;
    * ``input_order`` (int32 ``[K]``) of a GPTQ layer in activation order converted by
      :mod:`replica.quant.gptq`: the input each of its columns takes, kept as
      ``carpool_input_order`` (int64) for :mod:`replica.quant.compressed`.

    Other unexpected tensors are logged.

    Raises:
        ValueError: a tensor other than a zero point mismatched (the checkpoint does not fit the
            model), naming it and both shapes.
    """
    names = []
    for name, stored, built in mismatched:
        if not name.endswith(".weight_zero_point"):
            raise _mismatch(name, stored, built)
        names.append(name)
    names += [name for name in unexpected if name.endswith(".input_order")]
    others = sorted(name for name in unexpected if not name.endswith(".input_order"))
    if others:
        logger.warning("quantization %s: the checkpoint's %s are not the model's (left out)", NAME, ", ".join(others[:5]))
    _set_from_files(model, path, names)


# A quantized layer's tensors as compressed-tensors stores them (``weight``: int-quantized's int8),
# and a converted GPTQ layer's input order.
COMPRESSED_PARTS = ("weight", "weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "input_order")


def load_whole_compressed(model: torch.nn.Module, path: str, mismatched) -> None:
    """Under tensor parallelism: set every quantized layer's compressed tensors (:data:`COMPRESSED_PARTS`)
    whole from the files of the checkpoint at ``path``, as stored (transformers' plan cuts packed
    integers, their scales and their ``weight_shape`` as if they were the weight; each rank cuts
    its part of the layer's blocks instead, :func:`replica.quant.compressed.quantize_from_compressed`); an input order is
    kept as ``carpool_input_order`` (int64).

    Floating tensors (scales) take the dtype transformers gave them, as at one rank.

    Raises:
        ValueError: a tensor other than a quantized layer's mismatched (``mismatched``:
            transformers' ``(name, checkpoint shape, model shape)``), or a layer's weights as
            stored (its ``weight_shape``, or its int8 ``weight``'s) or its scales' rows are not
            the layer's ``[out_features, in_features]``, naming it and both shapes.
    """
    from compressed_tensors.utils.safetensors_load import get_checkpoint_files, get_weight_map

    layers = {name: module for name, module in model.named_modules() if getattr(module, "quantization_scheme", None) is not None}
    for name, stored, built in mismatched:
        if name.rsplit(".", 1)[0] not in layers:
            raise _mismatch(name, stored, built)
    names = [name for name in get_weight_map(get_checkpoint_files(path))
             if name.rsplit(".", 1)[0] in layers and name.rsplit(".", 1)[1] in COMPRESSED_PARTS]
    _set_from_files(model, path, names)
    for name, module in layers.items():
        shape = tuple(module.weight_shape.tolist()) if hasattr(module, "weight_shape") else tuple(module.weight.shape)
        wanted = (module.out_features, module.in_features)
        if shape != wanted or module.weight_scale.shape[0] != wanted[0]:
            raise ValueError(f"quantization {NAME}: the checkpoint's {name} is {shape} (scales for {module.weight_scale.shape[0]} "
                             f"rows), the model's {wanted}")


def _mismatch(name: str, stored, built) -> ValueError:
    """The refusal of a checkpoint tensor ``name`` of shape ``stored`` where the model has ``built``."""
    return ValueError(f"quantization {NAME}: the checkpoint's {name} is {tuple(stored)}, the model's {tuple(built)}")


def _set_from_files(model: torch.nn.Module, path: str, names: list[str]) -> None:
    """Set each tensor ``names`` names (``<layer>.<part>``) from the checkpoint's files at
    ``path`` on its layer, as stored: an ``input_order`` as ``carpool_input_order`` (int64), any
    other part as a parameter of its name (a floating one in the dtype of the parameter it
    replaces, where transformers built one)."""
    from compressed_tensors.utils.safetensors_load import get_checkpoint_files, get_weight_map
    from safetensors import safe_open

    if not names:
        return
    files = get_checkpoint_files(path)
    where = get_weight_map(files)
    for shard in sorted({where[name] for name in names}):
        with safe_open(files[shard], framework="pt") as file:
            for name in (name for name in names if where[name] == shard):
                module_name, part = name.rsplit(".", 1)
                module = model.get_submodule(module_name)
                tensor = file.get_tensor(name)
                if part == "input_order":
                    module.carpool_input_order = tensor.long()
                    continue
                built = getattr(module, part, None)
                if built is not None and built.is_floating_point() and tensor.is_floating_point():
                    tensor = tensor.to(built.dtype)  # scales: the dtype transformers loads them in
                setattr(module, part, torch.nn.Parameter(tensor, requires_grad=False))
