"""Compute a model's linear layers from its GGUF file's quantized blocks (``--quantization gguf``).

The model itself is built by transformers from the same file (de-quantized: config, norms,
embeddings; ``replica.config.model_files``). :func:`quantize_from_gguf` then reads each linear
layer's tensor from the file with the ``gguf`` package, as stored, and routes the layer through
Carpool's 4-bit or 8-bit kernel (:mod:`replica.quant.blocks`). Tensor names are mapped as transformers' own
GGUF loader does it (the ``gguf`` package's ``get_tensor_name_map`` for the file's architecture), and the rows of a Llama file's query and key
projections are put back in transformers' order with its ``LlamaTensorProcessor`` (llama.cpp's
converter permutes them; a row permutation moves whole blocks, so it applies to the blocks as is).

Types: Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K (4-bit kernel, 5-bit values with a plane of fifth
bits), Q8_0 and Q6_K (8-bit kernel) go to the kernels (so the common Q4_0, Q4_1, Q5_0, Q8_0,
Q4_K_S/M, Q5_K_S/M and Q6_K files run whole); F32, F16 and BF16 layers stay as loaded; any other
type of a linear layer (Q2_K, Q3_K, IQ types, ...) is refused, naming the tensor and its type.
A tied output layer (no ``output.weight`` in the file) is computed from the input embedding's
tensor where its type is one of those (else both stay as loaded); where it is 8-bit (Q8_0, or Q6_K
as llama.cpp's K-quant mixes store it), the input embedding reads its rows from the same packed
blocks (:func:`~replica.quant.blocks.embed_from_blocks`) and its dense copy is released. Each packed layer is checked against the weight transformers
de-quantized from the same tensor (equal after rounding to the model's dtype), so a wrong name map
or row order fails at start, not in tokens.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from replica.quant.blocks import dequantize, embed_from_blocks, shard_blocks, tied_output, use_blocks
from replica.quant.gguf_blocks import GGUF_BLOCK_TYPES, split_gguf_blocks

logger = logging.getLogger(__name__)

DENSE_TYPES = ("F32", "F16", "BF16")
# GGUF architectures whose transformers tensor processor leaves linear layers' blocks whole (the
# default processor: names only) or permutes their rows (llama).
_ROW_SAFE_PROCESSORS = ("llama",)


def quantize_from_gguf(model: torch.nn.Module, gguf_file: str | Path) -> int:
    """Route each linear layer of ``model`` stored as a type of ``GGUF_BLOCK_TYPES`` in ``gguf_file`` (and a
    tied output layer, from the input embedding's tensor) through its kernel; returns how many.

    Under tensor parallelism each layer holds its rank's part (``carpool_tp_part``, set by
    :func:`replica.worker.parallel.localize`: rows or inputs) and takes that part of the blocks
    (:func:`~replica.quant.blocks.shard_blocks`), or stays as loaded where the part is not whole
    blocks of 32 (the log counts those); a tied output layer's part comes from the embedding's
    tensor, and the input embedding, whole on every rank, stays as loaded.

    Raises:
        ValueError: the file's architecture has a tensor processor that reshapes tensors (MoE
            experts, fused QKV); a linear layer's tensor has a type the kernel does not read (the
            message names the tensor and its type); a layer's blocks stand for a NaN or infinite
            weight; a packed layer disagrees with the weight transformers de-quantized from it.
    """
    from gguf import MODEL_ARCH_NAMES, GGUFReader, get_tensor_name_map
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    reader = GGUFReader(str(gguf_file))
    architecture = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    if architecture in TENSOR_PROCESSORS and architecture not in _ROW_SAFE_PROCESSORS:
        raise ValueError(
            f"{gguf_file}: quantization gguf does not read {architecture!r} files yet (transformers "
            f"reshapes their tensors at load); serve it without quantization"
        )
    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == architecture), None)
    if arch is None:
        raise ValueError(f"{gguf_file}: the gguf package does not know the architecture {architecture!r}")
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=model.config.to_dict())
    name_map = get_tensor_name_map(arch, model.config.get_text_config().num_hidden_layers)
    linears = {}  # GGUF tensor name -> (transformers module name, module)
    for name, module in model.named_modules():
        gguf_name = name_map.get_name(name) if isinstance(module, torch.nn.Linear) else None
        if gguf_name is not None:
            linears[gguf_name + ".weight"] = (name, module)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    shared, tied = tied_output(model)
    if tied and "output.weight" not in tensors and "token_embd.weight" in tensors:
        linears = {k: v for k, v in linears.items() if v[1] is not head}
        linears["token_embd.weight"] = (next(n for n, m in model.named_modules() if m is head), head)
    count = dense = 0
    for tensor_name, (target, module) in linears.items():
        tensor = tensors.get(tensor_name)
        if tensor is None or tensor.tensor_type.name in DENSE_TYPES:
            continue
        type_name = tensor.tensor_type.name
        if type_name not in GGUF_BLOCK_TYPES and module is head and tied:
            continue  # the tied head and embedding stay as transformers loaded them
        if type_name not in GGUF_BLOCK_TYPES:
            raise ValueError(
                f"{gguf_file}: tensor {tensor_name} ({target}) is {type_name}; quantization gguf computes "
                f"{', '.join(GGUF_BLOCK_TYPES)} layers ({', '.join(DENSE_TYPES)} stay as they are)"
            )
        raw = processor.process(weights=tensor.data, name=tensor_name).weights
        weight = split_gguf_blocks(torch.from_numpy(raw.copy()), type_name)
        expected = module.weight.detach()
        part = getattr(module, "carpool_tp_part", None)
        weight = weight if part is None else shard_blocks(weight, *part) if part[0] is not None else None
        if weight is None:
            dense += 1
            continue
        values = dequantize(weight)
        if not values.isfinite().all():
            raise ValueError(f"{gguf_file}: tensor {tensor_name} ({target}) holds non-finite weights (a NaN or infinite block scale)")
        if weight.shape != tuple(expected.shape) or not torch.equal(values.to(expected.dtype), expected):
            raise ValueError(f"{gguf_file}: tensor {tensor_name} does not match {target} as transformers loads it")
        use_blocks(module, weight)
        if module is head and shared:
            embed_from_blocks(embedding, head, expected.dtype)
        count += 1
    logger.info("quantization gguf: %d linear layers computed from %s's blocks%s", count, Path(gguf_file).name,
                f", {dense} left as loaded (this rank's part is not whole blocks)" if dense else "")
    return count
