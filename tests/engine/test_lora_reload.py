"""LoRA adapters read again, and malformed ones: an adapter retrained into the same folder never
meets its earlier weights' K/V in the prefix cache, and whatever a malformed adapter trips is a
LoRAAdapterError (HTTP 400), not another exception (which the ingress would answer with 503)."""

from __future__ import annotations

import os

import pytest
from safetensors.torch import load_file, save_file

from replica import LLM, LoRARequest, SamplingParams
from replica.protocol.errors import LoRAAdapterError
from tests.helpers import ON_TEST_DEVICE, assert_idle
from tests.lora_adapters import edit_adapter_config, make_adapter, peft_greedy

PROMPT = list(range(101, 137))  # 36 tokens: two full blocks of 16, cached after the first request
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=tiny_llama, dtype="float32", **ON_TEST_DEVICE, enable_lora=True, max_loras=2,
               max_lora_rank=16, max_num_seqs=4, block_size=16, num_blocks=64, compile=False)


def _tokens(llm, lora) -> list[int]:
    return llm.generate(prompt_token_ids=[PROMPT], sampling_params=GREEDY, lora_request=lora)[0].outputs[0].token_ids


def test_an_adapter_retrained_into_its_folder_gets_its_new_tokens(llm, tiny_llama, tmp_path):
    folder = tmp_path / "x"
    lora = LoRARequest("x", 1, str(folder))
    make_adapter(tiny_llama, folder, r=8, seed=1)
    first = _tokens(llm, lora)
    assert first == peft_greedy(tiny_llama, str(folder), [PROMPT], [8])[0]
    hits = llm.engine.scheduler.prefix_cache_hits
    make_adapter(tiny_llama, folder, r=8, seed=2)  # retrained: new weights, same name and folder
    assert llm.engine.remove_lora("x")  # unloaded; the next request reads the folder again
    expected = peft_greedy(tiny_llama, str(folder), [PROMPT], [8])[0]
    assert expected != first
    assert _tokens(llm, lora) == expected
    assert llm.engine.scheduler.prefix_cache_hits == hits  # the old weights' blocks were not reused
    assert _tokens(llm, lora) == expected
    assert llm.engine.scheduler.prefix_cache_hits > hits  # the new weights' blocks are
    assert_idle(llm.engine)


def _rank_zero(folder):
    path = os.path.join(folder, "adapter_model.safetensors")
    state = load_file(path)
    save_file({k: v[:0] if ".lora_A." in k else v[:, :0] for k, v in state.items()}, path)


def _scalar_a(folder):
    path = os.path.join(folder, "adapter_model.safetensors")
    state = load_file(path)
    save_file({k: v[0, 0].clone() if ".lora_A." in k else v for k, v in state.items()}, path)


MALFORMED = {
    "rank-zero": (_rank_zero, "lora_A"),
    "scalar-lora-A": (_scalar_a, "lora_A"),
    "lora-alpha-null": (lambda f: edit_adapter_config(f, lora_alpha=None), "lora_alpha"),
    "alpha-pattern-null": (lambda f: edit_adapter_config(f, alpha_pattern=None), None),
    "config-not-json": (lambda f: open(os.path.join(f, "adapter_config.json"), "w").write("{"), "adapter_config.json"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_adapter_is_a_lora_adapter_error(llm, tiny_llama, tmp_path, case):
    break_it, named = MALFORMED[case]
    folder = make_adapter(tiny_llama, tmp_path / case, r=8, seed=3)
    before = peft_greedy(tiny_llama, folder, [PROMPT], [8])[0] if named is None else None
    break_it(folder)
    lora = LoRARequest(case, 1, folder)
    if named is None:  # no alpha pattern: served as without one (PEFT itself raises on null)
        assert _tokens(llm, lora) == before
    else:
        with pytest.raises(LoRAAdapterError, match=named):
            llm.generate(prompt_token_ids=[PROMPT], sampling_params=GREEDY, lora_request=lora)
    assert not llm.engine.has_unfinished_requests()
    assert _tokens(llm, None) == _tokens(llm, None)  # the engine serves on
    assert_idle(llm.engine)
