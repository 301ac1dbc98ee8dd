"""Tiny random-weight models (Llama, Qwen2, Qwen3) saved as ordinary model folders.

Each folder holds a config, random weights and the SmolLM2 tokenizer (vocabulary 49152), so the
engine loads it through the same code path as a real model and text tests work.
"""

from __future__ import annotations

import pytest
import torch

TINY = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
    # Larger weights than the default 0.02 make logits decisive, so greedy ties (which float
    # rounding could flip between two correct implementations) do not occur.
    initializer_range=0.3,
)


def _config(family: str):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    if family == "llama":
        return LlamaConfig(**TINY)
    if family == "qwen2":
        return Qwen2Config(**TINY, use_sliding_window=False)
    if family == "qwen3":
        return Qwen3Config(**TINY, head_dim=16, use_sliding_window=False)
    raise ValueError(family)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory, smollm2_tokenizer):
    """``make(family) -> folder`` of a tiny random model of that family (built once per session)."""
    from transformers import AutoModelForCausalLM

    built: dict[str, str] = {}

    def make(family: str) -> str:
        if family not in built:
            torch.manual_seed(1234)
            model = AutoModelForCausalLM.from_config(_config(family), dtype=torch.float32)
            folder = tmp_path_factory.mktemp(f"tiny-{family}")
            model.save_pretrained(folder)
            smollm2_tokenizer.save_pretrained(folder)
            built[family] = str(folder)
        return built[family]

    return make


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory) -> str:
    return tiny_model_factory("llama")
