"""Write a model folder with random weights in a real model's shape, for timing runs on machines
that cannot reach a model hub (the device machine): speed depends on shapes, not on weight values.

    python -m tests.gpu.make_random_model --tokenizer DIR --shape smollm2-135m --out DIR [--device cuda]

Shapes: ``smollm2-135m`` (HuggingFaceTB/SmolLM2-135M: 30 layers, hidden 576, 9 heads, 3 KV heads),
``qwen2.5-0.5b`` (Qwen/Qwen2.5-0.5B: a Qwen2 model of 24 layers, hidden 896, 14 heads, 2 KV heads,
MLP 4864; its query, key and value biases) and ``llama3-8b`` (Meta Llama 3 8B: 32 layers, hidden 4096, 32 heads, 8 KV heads, MLP 14336) with
the SmolLM2 vocabulary (49152) so one tokenizer serves both. Weights are drawn on ``--device``
(GPU initialization of 8B parameters takes seconds; on CPU, minutes) and saved as bf16 safetensors.
"""

from __future__ import annotations

import argparse
import time

import torch

SHAPES = {
    "smollm2-135m": dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, tie_word_embeddings=True, rope_theta=100000.0,
    ),
    "qwen2.5-0.5b": dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1000000.0,
    ),
    "llama3-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, tie_word_embeddings=False, rope_theta=500000.0,
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True, help="Folder with the SmolLM2 tokenizer files.")
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config

    config = (Qwen2Config if args.shape.startswith("qwen") else LlamaConfig)(
        vocab_size=49152, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, pad_token_id=2,
        **SHAPES[args.shape],
    )
    start = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(args.out)
    AutoTokenizer.from_pretrained(args.tokenizer).save_pretrained(args.out)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.shape}: {params / 1e9:.2f} B parameters written to {args.out} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
