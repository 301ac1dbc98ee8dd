"""``quantization: gguf`` on a K-quant mix of the real default model: its package's file written
again as llama.cpp's Q4_K_M mix writes a model of its width (:func:`~tests.engine.gguf_files.k_quant_mix`:
Q4_K and Q6_K down projections, Q5_0 elsewhere, the tied embedding Q8_0), served by the engine
from that file. Alone = batched = preempted, and greedy tokens against transformers in float32 on
the same de-quantized weights (the kernels themselves are checked type by type in
``test_quantized_gguf.py``)."""

from __future__ import annotations

import os

import pytest
import torch

from replica import LLM, SamplingParams
from tests.engine.gguf_files import k_quant_mix, requantize_gguf
from tests.engine.test_quantized_gguf import CHATS, HAS_F32, POOL, TOKENS, _prompts, needs_bf16, teacher_forced
from tests.helpers import ON_TEST_DEVICE, assert_idle


@pytest.fixture(scope="module")
def mix_file():
    """The mix file, written once into Carpool's cache and kept: the engine converts a ``.gguf``
    file into a folder named by its path, size and time (about 0.5 GB here), so a file written
    anew each run would leave a new folder each run."""
    from replica.config.engine_config import DEFAULT_MODEL, cache_dir
    from replica.config.model_files import packaged_gguf_path

    path = cache_dir() / "test-models" / "smollm2-k-quant-mix.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        requantize_gguf(packaged_gguf_path(DEFAULT_MODEL), partial, k_quant_mix)
        partial.replace(path)  # whole or not at all
    return path


@needs_bf16
def test_a_k_quant_file_is_served_from_its_blocks_alone_equal_batched(mix_file, capsys):
    """Every linear layer on the kernels (Q4_K, and Q5_0 with its fifth bits, on the 4-bit kernel,
    Q5_0 on the 8-bit one where that is faster; Q6_K and Q8_0 on the 8-bit one); the eight chats at once (preempting, on the small pool) give each the
    tokens it got alone (eager); teacher-forced against float32 transformers on the file's de-quantized
    weights, at least 95 % of the greedy tokens agree and the others are near-ties (bf16
    activations round each layer's input, as on Q4_1 in ``test_quantized_gguf.py``, which runs
    the compiled engine)."""
    import gguf
    from transformers import AutoModelForCausalLM

    from replica.config.model_files import resolve_gguf_model

    types = {t.tensor_type.name for t in gguf.GGUFReader(str(mix_file)).tensors}
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0"} <= types
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    # Eager: the kernels are opaque ops either way, and a compile of this model's graphs would
    # double the module's time (the compiled path runs on the Q4_1 file in test_quantized_gguf.py).
    with LLM(model=str(mix_file), quantization="gguf", compile=False, **POOL) as llm:
        runner = llm.engine.runner
        assert runner.num_quantized == 211  # 30 layers x 7 linears, the tied head
        assert runner.model.model.layers[2].mlp.down_proj.carpool_q_super_scales is not None  # Q6_K
        q_proj = runner.model.model.layers[0].self_attn.q_proj  # Q5_0: 5-bit on AVX512, the 8-bit kernel on AVX2
        assert (q_proj.carpool_q_high is not None) == torch.ops.carpool_cpu.q4_planes_pay()
        assert runner.model.get_input_embeddings().weight.numel() == 0  # its rows from the head's Q8_0 blocks
        prompts = _prompts(llm.tokenizer)
        alone = [llm.generate(prompt_token_ids=[p], sampling_params=params)[0].outputs[0].token_ids for p in prompts]
        preempted = llm.engine.scheduler.num_preemptions
        batched = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
        assert batched == alone
        assert llm.engine.scheduler.num_preemptions > preempted
        assert_idle(llm.engine)
    reference = AutoModelForCausalLM.from_pretrained(resolve_gguf_model(str(mix_file))[0], dtype=torch.float32)
    agree, gaps = teacher_forced(reference, prompts, alone)
    with capsys.disabled():
        print(f"\nK-quant mix, bf16 greedy vs float32: {agree}/{len(CHATS) * TOKENS} agree; logprob gaps where not: {gaps}")
    assert agree >= 0.95 * len(CHATS) * TOKENS
    # Eager bf16 rounds each norm's steps apart (the compiled graph fuses them): its near-ties are
    # wider than the compiled engine's 0.35 (docs/bench/k-quants-cpu.md, "Fidelity").
    assert all(gap < 0.5 for gap in gaps), gaps


@pytest.mark.skipif(not HAS_F32, reason="no block kernels on this CPU (they need AVX512F, or AVX2 with FMA and F16C)")
def test_float32_greedy_tokens_are_transformers_own_on_the_k_quant_weights(mix_file):
    """With float32 activations the kernels differ from transformers on the de-quantized weights
    only in the order of float32 sums: every greedy token is the one transformers ranks first
    after the same prefix (teacher-forced, 256 positions)."""
    from transformers import AutoModelForCausalLM

    from replica.config.model_files import resolve_gguf_model

    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    with LLM(model=str(mix_file), quantization="gguf", dtype="float32", compile=False, max_num_seqs=8, **ON_TEST_DEVICE) as llm:
        prompts = _prompts(llm.tokenizer)
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
        assert llm.engine.runner.num_quantized == 211
        assert_idle(llm.engine)
    reference = AutoModelForCausalLM.from_pretrained(resolve_gguf_model(str(mix_file))[0], dtype=torch.float32)
    assert teacher_forced(reference, prompts, outputs) == (len(prompts) * TOKENS, [])
