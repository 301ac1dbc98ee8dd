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


# A tiny Llama in the default model's vocabulary: 2 layers, 64 wide (4 heads of 16, 2 KV heads),
# 256 wide MLP (so its down projections take K-quants, whose super-blocks of 256 a cut into 2
# tensor-parallel parts splits).
TINY_SIZES = {
    "llama.block_count": 2, "llama.embedding_length": 64, "llama.feed_forward_length": 256,
    "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2, "llama.rope.dimension_count": 16,
    "llama.context_length": 2048,
}


def tiny_gguf(source: Path, target: Path, types: dict[str, str], default: str = "Q4_1", seed: int = 0) -> None:
    """A tiny Llama GGUF file (:data:`TINY_SIZES`) with ``source``'s metadata (tokenizer, chat
    template, rope and norm settings) and random weights: each linear tensor of the GGUF name
    in ``types`` in that type, others ``default``, the (tied) embedding Q8_0 unless named, norms F32."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(target), "llama")
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = TINY_SIZES.get(field.name, field.contents())
        writer.add_key_value(field.name, value, kind, sub_type=sub_type)
    width, mlp = TINY_SIZES["llama.embedding_length"], TINY_SIZES["llama.feed_forward_length"]
    kv = width // TINY_SIZES["llama.attention.head_count"] * TINY_SIZES["llama.attention.head_count_kv"]
    vocab = int(reader.fields["llama.vocab_size"].contents())
    shapes = {"token_embd": (vocab, width), "output_norm": (width,)}
    for layer in range(TINY_SIZES["llama.block_count"]):
        shapes.update({f"blk.{layer}.{name}": shape for name, shape in {
            "attn_norm": (width,), "ffn_norm": (width,), "attn_q": (width, width), "attn_k": (kv, width),
            "attn_v": (kv, width), "attn_output": (width, width), "ffn_gate": (mlp, width), "ffn_up": (mlp, width),
            "ffn_down": (width, mlp),
        }.items()})
    generator = torch.Generator().manual_seed(seed)
    for name, shape in shapes.items():
        if len(shape) == 1:
            writer.add_tensor(name + ".weight", np.ones(shape, dtype=np.float32))
            continue
        scale = 0.5 if name == "token_embd" else 0.15
        weight = torch.randn(shape, generator=generator) * scale
        type_name = types.get(name + ".weight", "Q8_0" if name == "token_embd" else default)
        writer.add_tensor(name + ".weight", ggml_blocks(weight, type_name), raw_dtype=gguf.GGMLQuantizationType[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
