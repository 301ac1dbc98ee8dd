"""Tiny random-weight models (Llama, Qwen2, Qwen3; Mistral and Gemma 3 with a sliding window of
``SLIDING_WINDOW`` tokens; Falcon, whose layers drop attention arguments; Gemma 2, GPT-OSS,
DiffLlama and DeepSeek V3, which the engine refuses) saved as ordinary model folders.

Each folder holds a config, random weights and the SmolLM2 tokenizer (vocabulary 49152), so the
engine loads it through the same code path as a real model and text tests work.

``llm``, ``engine`` and ``base`` are one small engine on the tiny Llama and its greedy reference,
built once for each module that uses them.
"""

from __future__ import annotations

import pytest
import torch

from replica import LLM
from replica.engine.llm_engine import LLMEngine
from tests.engine.tiny_engine import MAX_MODEL_LEN, PROMPT, greedy
from tests.helpers import ON_TEST_DEVICE, assert_idle

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


SLIDING_WINDOW = 160  # tokens: past the fidelity workload's longest sequence (130)
LONGROPE_SHORT_LEN = 64  # tokens: a longrope model's original_max_position_embeddings


def _config(family: str):
    from transformers import Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if family == "llama":
        return LlamaConfig(**TINY)
    if family == "qwen2":
        return Qwen2Config(**TINY, use_sliding_window=False)
    if family == "qwen3":
        return Qwen3Config(**TINY, head_dim=16, use_sliding_window=False)
    if family == "mistral":  # every layer windowed
        return MistralConfig(**TINY, sliding_window=SLIDING_WINDOW)
    if family == "gemma3":  # windowed and global layers in turn
        return Gemma3TextConfig(
            **TINY, head_dim=16, query_pre_attn_scalar=16, sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention"],
        )
    if family == "gemma2":  # logit soft-capping in attention (which Carpool refuses)
        return Gemma2Config(**TINY, head_dim=16, query_pre_attn_scalar=16, sliding_window=SLIDING_WINDOW)
    if family == "falcon":  # its attention layers do not pass transformers' attention arguments on
        from transformers import FalconConfig

        return FalconConfig(**{k: v for k, v in TINY.items() if k not in ("intermediate_size", "num_key_value_heads")})
    if family == "phi":  # partial rotary: the query reaches attention non-contiguous (torch.cat)
        from transformers import PhiConfig

        return PhiConfig(**{k: v for k, v in TINY.items() if k != "num_key_value_heads"}, partial_rotary_factor=0.5)
    if family == "stablelm":  # partial rotary, and its layers drop transformers' attention arguments
        from transformers import StableLmConfig

        return StableLmConfig(**TINY, partial_rotary_factor=0.5)
    if family == "phi3_longrope":  # longrope: short rotary factors up to 64 tokens, long past them
        from transformers import Phi3Config

        return Phi3Config(
            **TINY, original_max_position_embeddings=LONGROPE_SHORT_LEN, sliding_window=None,
            rope_parameters={
                "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                "long_factor": [1.0 + 3.0 * i for i in range(8)], "original_max_position_embeddings": LONGROPE_SHORT_LEN,
            },
        )
    if family == "diffllama":  # calls attention twice per layer (which Carpool refuses)
        from transformers import DiffLlamaConfig

        return DiffLlamaConfig(**TINY)
    if family == "deepseek_v3":  # multi-head latent attention: values narrower than keys (refused)
        from transformers import DeepseekV3Config

        return DeepseekV3Config(
            **TINY, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
            kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_group=1, topk_group=1,
        )
    if family == "gpt_oss":  # attention sinks (which Carpool refuses)
        from transformers import GptOssConfig

        tiny = {k: v for k, v in TINY.items() if k != "tie_word_embeddings"}
        return GptOssConfig(**tiny, head_dim=16, num_local_experts=2, num_experts_per_tok=1, sliding_window=SLIDING_WINDOW)
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


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    """One small engine per test module that asks for it (modules with their own ``llm`` override
    it): the tiny Llama in float32, 4 seats, 32 blocks of 16, max_model_len 128."""
    return LLM(
        model=tiny_llama, dtype="float32", **ON_TEST_DEVICE, max_num_seqs=4, block_size=16, num_blocks=32, max_model_len=MAX_MODEL_LEN
    )


@pytest.fixture
def engine(llm) -> LLMEngine:
    assert_idle(llm.engine)  # a failed earlier test must not leak into this one
    return llm.engine


@pytest.fixture(scope="module")
def base(llm):
    """The greedy reference: PROMPT's first 24 tokens and text, no stop of any kind."""
    [out] = llm.generate(prompt_token_ids=[PROMPT], sampling_params=greedy(max_tokens=24))
    c = out.outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 24
    assert 2 not in c.token_ids
    assert c.text == llm.tokenizer.decode(c.token_ids)  # byte-level BPE: the plain decode
    return c.token_ids, c.text


@pytest.fixture(scope="session")
def ct_checkpoints(tiny_llama, tmp_path_factory):
    """``get(scheme, **kwargs) -> folder``: the tiny Llama written as a compressed-tensors
    checkpoint of that scheme (``tests/engine/compressed_files.py``), once per session."""
    from tests.engine.compressed_files import write_compressed

    made: dict[tuple, str] = {}

    def get(scheme: str, **kwargs) -> str:
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        key = (scheme, *sorted(kwargs.items(), key=str))
        if key not in made:
            made[key] = str(write_compressed(tiny_llama, tmp_path_factory.mktemp(scheme), scheme, **kwargs))
        return made[key]

    return get
