"""The real default model (SmolLM2-135M-Instruct, converted from the packaged GGUF)."""

from __future__ import annotations

import pytest
import torch

from replica import LLM, SamplingParams
from tests.helpers import assert_idle

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for better sleep.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
]


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(model=smollm2_path, dtype="float32", max_num_seqs=8)


def test_default_model_id_resolves_offline():
    """The hub id resolves to the packaged copy when no hub is reachable (as on CI)."""
    from replica.config.engine_config import DEFAULT_MODEL
    from replica.config.model_files import resolve_model_path

    path = resolve_model_path(DEFAULT_MODEL)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    assert (config.model_type, config.num_hidden_layers, config.num_attention_heads) == ("llama", 30, 9)
    assert (config.num_key_value_heads, config.vocab_size) == (3, 49152)


def test_greedy_matches_transformers_generate_on_smollm2(llm, smollm2_path):
    from transformers import AutoModelForCausalLM

    tokenizer = llm.tokenizer
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True, return_dict=False)
        for c in CHATS
    ]
    params = SamplingParams(temperature=0, max_tokens=24)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)

    reference = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    for ids, out in zip(prompts, outputs):
        expected = reference.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=24, do_sample=False,
        )[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == expected
        assert out.outputs[0].text == tokenizer.decode(expected, skip_special_tokens=True)
        assert out.outputs[0].finish_reason == ("stop" if expected[-1] == 2 else "length")
    assert "Paris" in outputs[0].outputs[0].text
    assert_idle(llm.engine)


def test_text_prompt_and_chat_answer(llm):
    [out] = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))
    assert out.prompt_token_ids == llm.tokenizer.encode("The capital of France is")
    assert "Paris" in out.outputs[0].text
    assert_idle(llm.engine)
