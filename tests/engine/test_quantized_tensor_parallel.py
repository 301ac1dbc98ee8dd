"""``quantization: gguf`` under tensor parallelism: each rank computes its part of every layer
from the file's blocks. A rank's part of a weight's blocks (rows, or whole blocks of inputs, a
K-quant super-block the cut splits under repeated scales) stands for exactly those weights and
runs on the kernels; a tiny Llama GGUF file of every kernel type served over 2 ranks gives
transformers' float32 greedy tokens on the file's weights, and alone = batched on 2 ranks in bf16."""

from __future__ import annotations

import os

import pytest
import torch

from replica import LLM, SamplingParams
from replica.quant.blocks import block_linear, dequantize, pack_weight, part_bounds, shard_blocks
from tests.engine.block_kernel_checks import FORMS, _weight
from tests.engine.gguf_files import tiny_gguf
from tests.engine.test_quantized_gguf import needs_bf16, needs_f32
from tests.engine.test_quantized_online import PROMPTS, _greedy
from tests.helpers import assert_idle


@needs_f32
@pytest.mark.parametrize("form", FORMS)
def test_a_rank_s_part_of_the_blocks_stands_for_its_rows_or_columns(form):
    """Parts 2 and 3 along the rows (40: 20 each, or 14, 14 and 12 as torch's chunks) and the
    inputs (K-quants: K = 768, so halves split super-blocks of 256 and thirds do not; groups of
    128 split in halves of 192) are the weights' slices, and the kernel on each part computes
    them; a part of the inputs that is not whole blocks is None."""
    torch.manual_seed(2)
    k = 768 if form.endswith("_K") else 384
    weight = _weight(form, k)
    full = dequantize(weight)
    x = torch.randn(5, k)
    for dim, parts in ((0, 2), (0, 3), (1, 2), (1, 3)):
        for index in range(parts):
            part = shard_blocks(weight, dim, index, parts)
            start, length = part_bounds(weight.shape[dim], index, parts)
            cut = slice(start, start + length)
            expected = full[cut] if dim == 0 else full[:, cut]
            assert torch.equal(dequantize(part), expected), (dim, parts, index)
            rows = x if dim == 0 else x[:, cut]
            got = block_linear(rows, pack_weight(part), None, part.shape[0], part.offset, part.bits)
            torch.testing.assert_close(got.double(), rows.double() @ expected.double().T, rtol=1e-5, atol=1e-4)
    assert [shard_blocks(weight, 0, i, 3).shape[0] for i in range(3)] == [14, 14, 12]
    if form.endswith("_K"):  # halves of 384 inputs: super-blocks of 128, the scales repeated
        assert shard_blocks(weight, 1, 0, 2).super_scales.shape == (40, 3)
    assert shard_blocks(weight, 1, 0, 8 if k == 384 else 16) is None  # parts of 48 inputs: not whole blocks
    assert shard_blocks(weight, 1, 0, 5) is None  # torch's chunks of ceil(K / 5): not whole blocks
    with pytest.raises(ValueError, match="no part"):
        shard_blocks(weight, 1, 2, 2)


@pytest.fixture(scope="module")
def tiny_file():
    """A tiny Llama GGUF file of every type the kernels take, written once into Carpool's cache
    and kept (the engine converts a ``.gguf`` file into a folder named by its path, size and time,
    so a file written anew each run would leave a folder each run)."""
    from replica.config.engine_config import DEFAULT_MODEL, cache_dir
    from replica.config.model_files import packaged_gguf_path

    path = cache_dir() / "test-models" / "tiny-llama-mix.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        types = {
            "blk.0.ffn_down.weight": "Q4_K", "blk.1.ffn_down.weight": "Q6_K",
            "blk.0.attn_q.weight": "Q5_0", "blk.1.ffn_up.weight": "Q5_1", "blk.1.attn_v.weight": "Q4_0",
            "blk.0.ffn_gate.weight": "Q8_0",
        }
        tiny_gguf(packaged_gguf_path(DEFAULT_MODEL), partial, types)
        partial.replace(path)  # whole or not at all
    return str(path)


@needs_f32
def test_2_ranks_compute_a_gguf_file_s_parts_with_transformers_tokens(tiny_file):
    """float32, eager, 2 ranks: every linear layer (and the tied head, from the embedding's Q8_0
    blocks) on the kernels, each rank its part (the Q4_K down projection's halves of 256 inputs
    under super-blocks of 128); the input embedding stays whole on every rank; greedy tokens are
    transformers' on the file's de-quantized weights."""
    from transformers import AutoModelForCausalLM

    from replica.config.model_files import resolve_gguf_model

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(model=tiny_file, quantization="gguf", dtype="float32", compile=False, tensor_parallel_size=2,
             max_num_seqs=4, num_blocks=64) as llm:
        runner = llm.engine.runner
        assert runner.tp.world_size == 2 and runner.num_quantized == 7 * 2 + 1
        down = runner.model.model.layers[0].mlp.down_proj
        assert down.carpool_in_features == 128 and down.carpool_q_super_scales.shape[1] == 1  # [G, S, 16]: one super-block of 128
        assert runner.model.lm_head.carpool_out_features == 49152 // 2
        assert runner.model.get_input_embeddings().weight.shape == (49152, 64)
        got = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)]
        assert_idle(llm.engine)
    reference = AutoModelForCausalLM.from_pretrained(resolve_gguf_model(tiny_file)[0], dtype=torch.float32)
    assert got == _greedy(reference, PROMPTS, 24)


@needs_bf16
def test_2_ranks_in_bf16_give_each_request_its_tokens_alone(tiny_file):
    """bf16 activations, compiled, 2 ranks: the prompts at once, in prefill chunks of 16 tokens,
    give each the tokens it got alone."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with LLM(model=tiny_file, quantization="gguf", tensor_parallel_size=2, max_num_seqs=4, num_blocks=64,
             max_num_batched_tokens=16) as llm:
        alone = [llm.generate(prompt_token_ids=[p], sampling_params=params)[0].outputs[0].token_ids for p in PROMPTS]
        batched = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)]
        assert_idle(llm.engine)
    assert batched == alone


CHECKPOINTS = {  # name -> how it is written: compressed-tensors (scheme, scale dtype) or an AWQ/GPTQ variant
    "w4a16-asym": ("ct", "w4a16-asym", torch.float16),
    "w4a16-float32-scales": ("ct", "w4a16", torch.float32),  # de-quantized: fp16 does not hold its scales
    "awq": ("awq-gptq", "awq", None),
    "gptq-8-sym": ("awq-gptq", "gptq-8-sym", None),
    "gptq-4-act-order": ("awq-gptq", "gptq-4-act-order", None),
}


@needs_f32
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_2_ranks_compute_a_checkpoint_s_parts_with_transformers_tokens(name, ct_checkpoints, tiny_llama, tmp_path, monkeypatch):
    """compressed-tensors, AWQ and GPTQ checkpoints over 2 ranks (float32, eager): each layer is
    read whole from the files, checked whole, and keeps its rank's part, on the kernels, or
    de-quantized where the kernels would not be exact (float32 scales) or where a row-wise layer's
    columns are in GPTQ's activation order; greedy tokens are transformers' on the checkpoint's
    weights."""
    from transformers import AutoModelForCausalLM

    from tests.engine.test_quantized_awq_gptq import VARIANTS
    from tests.engine.test_quantized_compressed import _transformers

    monkeypatch.setenv("CARPOOL_CACHE_DIR", str(tmp_path / "cache"))  # the AWQ and GPTQ conversions
    kind, scheme, scale_dtype = CHECKPOINTS[name]
    if kind == "ct":
        path = ct_checkpoints(scheme, scale_dtype=scale_dtype)
        reference = _transformers(path)
    else:
        writer, kwargs, *_ = VARIANTS[scheme]
        quantized, folder = writer(tiny_llama, tmp_path / scheme, **kwargs)
        path, reference = str(quantized), AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(model=path, dtype="float32", compile=False, tensor_parallel_size=2, max_num_seqs=4, num_blocks=64) as llm:
        runner = llm.engine.runner
        layers = runner.model.model.layers[0]
        dense = name == "w4a16-float32-scales"
        # Rows cut for the column-wise layers, inputs for the row-wise ones (128 and 64 wide).
        for layer, part in ((layers.mlp.up_proj, (64, 64)), (layers.mlp.down_proj, (64, 64)), (layers.self_attn.o_proj, (64, 32))):
            ordered = name == "gptq-4-act-order" and layer is not layers.mlp.up_proj
            if dense or ordered:  # its part of the de-quantized weight, prepacked
                assert not hasattr(layer, "carpool_q_weight") and not hasattr(layer, "weight_packed")
            else:
                assert (layer.carpool_out_features, layer.carpool_in_features) == part and layer.weight.numel() == 0
        assert runner.num_quantized == (0 if dense else 10 if name == "gptq-4-act-order" else 14)  # act order: o and down dense
        got = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)]
        assert_idle(llm.engine)
    assert got == _greedy(reference, PROMPTS, 24)



@needs_f32
def test_3_ranks_cut_uneven_parts_as_transformers_does(smollm2_tokenizer, tmp_path):
    """A model 96 wide (6 heads, 3 KV heads) with an MLP of 128 over 3 ranks: transformers gives
    the MLP's ranks 43, 43 and 42 rows (or inputs); a W4A16 checkpoint's ranks take the same
    parts (the up projections' rows on the kernels, the down projections' inputs, not whole
    blocks, dense), and the greedy tokens are transformers' own on the checkpoint."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.engine.compressed_files import write_compressed
    from tests.engine.conftest import TINY
    from tests.engine.test_quantized_compressed import _transformers

    torch.manual_seed(3)
    config = LlamaConfig(**{**TINY, "hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3})
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path / "dense")
    smollm2_tokenizer.save_pretrained(tmp_path / "dense")
    path = str(write_compressed(tmp_path / "dense", tmp_path / "w4a16", "w4a16", scale_dtype=torch.float16))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(model=path, dtype="float32", compile=False, tensor_parallel_size=3, max_num_seqs=4, num_blocks=64) as llm:
        runner = llm.engine.runner
        up = runner.model.model.layers[0].mlp.up_proj
        assert up.carpool_tp_part == (0, 0, 3) and up.carpool_out_features == 43  # rank 0's part
        assert runner.num_quantized == 6 * 2  # all but the down projections
        got = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)]
        assert_idle(llm.engine)
    assert got == _greedy(_transformers(path), PROMPTS, 24)


@needs_bf16
def test_2_ranks_load_scales_in_the_model_s_dtype_and_check_shapes(ct_checkpoints, tmp_path):
    """Each rank reads the layers whole from the files, its scales in the dtype transformers
    loads them in (bf16 here, from float32: on the kernels at 2 ranks as at 1); where no kernel
    runs (float16) each de-quantized layer keeps its rank's part; a checkpoint whose tensors are
    not its config's shapes is refused, naming the layer."""
    import json
    import shutil

    path = ct_checkpoints("w4a16", scale_dtype=torch.float32)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    counts = []
    for tp in (1, 2):
        with LLM(model=path, dtype="bfloat16", compile=False, tensor_parallel_size=tp, max_num_seqs=4, num_blocks=64) as llm:
            counts.append(llm.engine.runner.num_quantized)
            assert len(llm.generate(prompt_token_ids=PROMPTS[:2], sampling_params=params)[1].outputs[0].token_ids) == 8
            assert_idle(llm.engine)
    assert counts == [14, 14]
    # float16 (no kernel): the package de-quantizes each layer, and each rank keeps its part.
    with LLM(model=ct_checkpoints("w4a16", scale_dtype=torch.float16), dtype="float16", compile=False, tensor_parallel_size=2,
             max_num_seqs=4, num_blocks=64) as llm:
        down = llm.engine.runner.model.model.layers[0].mlp.down_proj
        assert llm.engine.runner.num_quantized == 0 and tuple(down.weight.shape) == (64, 64)  # half of 128 inputs
        assert len(llm.generate(prompt_token_ids=PROMPTS[:2], sampling_params=params)[1].outputs[0].token_ids) == 8
        assert_idle(llm.engine)
    wrong = shutil.copytree(path, tmp_path / "wrong")
    config = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**config, "intermediate_size": 64}))
    with pytest.raises(ValueError, match=r"the checkpoint's model\.layers\.\d\.mlp\.\w+_proj is \(\d+, \d+\) .*the model's"):
        LLM(model=str(wrong), dtype="float32", compile=False, tensor_parallel_size=2, max_num_seqs=4, num_blocks=64)
