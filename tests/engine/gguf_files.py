"""GGUF files for the tests: a GGUF file's tensors written again in other block types, with its
metadata (architecture, config, tokenizer) copied as ``gguf``'s own ``gguf_new_metadata`` script
copies it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from tests.engine.block_kernel_checks import ggml_blocks


def requantize_gguf(source: Path, target: Path, type_for: Callable[[str, tuple[int, int]], str | None]) -> None:
    """Write ``source``'s tensors to ``target``, each 2-D tensor ``name`` of ``[N, K]`` whose
    ``type_for(name, (N, K))`` names a type re-quantized to it from its de-quantized float32 values
    (None: copied as it is), and every metadata field copied."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    architecture = bytes(reader.fields[gguf.Keys.General.ARCHITECTURE].parts[-1]).decode()
    writer = gguf.GGUFWriter(str(target), architecture)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub_type)
    for tensor in reader.tensors:
        shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml's ne is [K, N]
        type_name = type_for(tensor.name, shape) if len(shape) == 2 else None
        if type_name is None or type_name == tensor.tensor_type.name:
            writer.add_tensor(tensor.name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type)
            continue
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        raw = ggml_blocks(torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)), type_name)
        writer.add_tensor(tensor.name, raw, raw_dtype=gguf.GGMLQuantizationType[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def k_quant_mix(name: str, shape: tuple[int, int]) -> str | None:
    """A Q4_K_M-like mix, as llama.cpp's ``llama-quantize`` writes it for a model whose width is
    not whole super-blocks (SmolLM2's 576): down projections Q4_K and, every third layer, Q6_K;
    other linear layers Q5_0 (its stand-in for Q4_K where K is not a multiple of 256); the tied
    embedding Q8_0 (for Q6_K)."""
    if name == "token_embd.weight":
        return "Q8_0"
    if not name.endswith(".weight") or ".ffn_norm" in name or "_norm" in name:
        return None
    if name.endswith("ffn_down.weight") and shape[1] % 256 == 0:
        return "Q6_K" if int(name.split(".")[1]) % 3 == 2 else "Q4_K"
    return "Q5_0"
