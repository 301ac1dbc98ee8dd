"""``quantization: gguf``: 4-bit GGUF blocks read as ggml writes them, Carpool's 4-bit kernel
against the weights they stand for, the loader on a tiny Llama written to a GGUF file (names, row
order, refusals), and the real default model served from its own Q4_1 file: alone = batched =
chunked = preempted, and against transformers in float32 on the same de-quantized weights."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from replica import LLM, SamplingParams
from replica.kernels import cpu_kernels
from replica.quant.blocks import BlockWeight, dequantize, pack_weight
from replica.quant.gguf_blocks import split_gguf_blocks
from tests.engine.block_kernel_checks import FORMS, TYPES, check_block_kernel, ggml_blocks
from tests.engine.test_real_model import CHATS as REAL_MODEL_CHATS
from tests.helpers import ON_TEST_DEVICE, assert_idle

HAS_BF16 = cpu_kernels.load() and cpu_kernels.has_block_gemv(torch.bfloat16)
HAS_F32 = cpu_kernels.available() and cpu_kernels.has_block_gemv(torch.float32)
needs_bf16 = pytest.mark.skipif(not HAS_BF16, reason="no block kernels on this CPU (they need AVX512F, or AVX2 with FMA and F16C)")
needs_f32 = pytest.mark.skipif(not HAS_F32, reason="no block kernels on this CPU (they need AVX512F, or AVX2 with FMA and F16C)")


@pytest.mark.parametrize("type_name", TYPES)
def test_blocks_read_as_ggml_writes_them(type_name):
    import gguf

    torch.manual_seed(0)
    k = 512 if type_name.endswith("_K") else 96  # K-quants: super-blocks of 256
    raw = ggml_blocks(torch.randn(48, k), type_name)
    weight = split_gguf_blocks(torch.from_numpy(raw), type_name)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
    assert weight.shape == (48, k) and (weight.mins is None) == (type_name not in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"))
    assert (weight.super_scales is None) == (not type_name.endswith("_K"))
    assert torch.equal(dequantize(weight), torch.from_numpy(expected))


def test_other_block_types_and_shapes_are_refused():
    with pytest.raises(ValueError, match="Q3_K"):
        split_gguf_blocks(torch.zeros(2, 110, dtype=torch.uint8), "Q3_K")
    with pytest.raises(ValueError, match="not whole 210-byte blocks"):
        split_gguf_blocks(torch.zeros(2, 200, dtype=torch.uint8), "Q6_K")
    with pytest.raises(ValueError, match="not whole 20-byte blocks"):
        split_gguf_blocks(torch.zeros(2, 30, dtype=torch.uint8), "Q4_1")
    odd = BlockWeight(torch.zeros(16, 40, dtype=torch.uint8), torch.ones(16, 1).half(), None, 8, 4)
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_weight(odd)


@pytest.mark.parametrize("dtype", [
    pytest.param(torch.bfloat16, marks=needs_bf16), pytest.param(torch.float32, marks=needs_f32),
], ids=["bf16", "fp32"])
@pytest.mark.parametrize("type_name", FORMS)
def test_kernel_computes_the_blocks_weights_and_a_row_never_depends_on_its_batch(type_name, dtype):
    check_block_kernel(type_name, dtype)


FORCED_ARCH = "haswell"  # AVX2, FMA and F16C, no AVX512


@pytest.mark.skipif(
    not {"avx512f", "avx2", "fma", "f16c"} <= (cpu_kernels._cpu_flags() or set()),
    reason="the AVX2 paths are what this CPU's own build runs (or the CPU cannot run them)",
)
def test_avx2_kernels_forced_on_an_avx512_cpu(tmp_path):
    """The AVX2 paths of the block kernels, built for Haswell on this AVX512 CPU (in a process of
    its own: the ops would clash with the native build's), pass the same checks."""
    import subprocess
    import sys

    code = f"from tests.engine.block_kernel_checks import forced_arch_checks; forced_arch_checks({FORCED_ARCH!r})"
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"checked {2 * len(FORMS)}" in out.stdout


def _llama_permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's row order for a query or key projection (``convert_hf_to_gguf.py``,
    ``LlamaModel.permute``): the inverse of what transformers' ``LlamaTensorProcessor`` undoes."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(model, path, types: dict[str, str], permute: bool = True, default: str = "Q4_1") -> None:
    """Write ``model``'s decoder linears and its (tied) input embedding to a GGUF file as
    llama.cpp would (``default``, the embedding Q8_0, unless ``types`` names another type for a GGUF
    tensor name), and set each weight to the blocks' de-quantized values (as transformers would
    load them from that file)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    config = model.config
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    types = {"token_embd.weight": "Q8_0", **types}
    for name, module in model.named_modules():
        gguf_name = name_map.get_name(name) if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) else None
        if gguf_name is None or name == "lm_head":
            continue
        weight = module.weight.detach().float()
        heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}.get(gguf_name.split(".")[-1])
        stored = _llama_permute(weight, heads) if heads and permute else weight
        type_name = types.get(gguf_name + ".weight", default)
        raw = ggml_blocks(stored, type_name)
        writer.add_tensor(gguf_name + ".weight", raw, raw_dtype=gguf.GGMLQuantizationType[type_name])
        values = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]))
        module.weight.data = (_unpermute(values, heads) if heads and permute else values).to(module.weight.dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _unpermute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    return weight.reshape(heads, weight.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(weight.shape)


def _tiny(path: str, dtype=torch.bfloat16):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


@needs_bf16
def test_a_tiny_llama_from_its_gguf_file_computes_its_weights(tiny_llama, tmp_path):
    """Every decoder linear of a tiny Llama and its tied embedding, written as llama.cpp does
    (query and key rows permuted; Q4_1, Q4_0 and Q8_0 layers, the embedding Q8_0), are read back
    in transformers' order and computed by the kernels: the head from the embedding's blocks, the
    embedding's rows too. Logits as the same de-quantized weights give in float32."""
    from replica.quant.gguf_weights import quantize_from_gguf

    model = _tiny(tiny_llama)
    write_gguf(model, tmp_path / "tiny.gguf", {"blk.0.attn_v.weight": "Q4_0", "blk.1.ffn_up.weight": "Q8_0"})
    reference = _tiny(tiny_llama, torch.float32)
    for name, module in model.named_modules():  # the de-quantized weights, exact in float32
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) and name != "lm_head":
            reference.get_submodule(name).weight.data = module.weight.data.float()
    embedded = model.get_input_embeddings()(torch.tensor([[5, 17, 49151]]))
    assert quantize_from_gguf(model, tmp_path / "tiny.gguf") == 7 * model.config.num_hidden_layers + 1
    assert model.model.layers[0].self_attn.q_proj.weight.numel() == 0  # the dense copies are released
    assert model.lm_head.weight.numel() == 0 and model.get_input_embeddings().weight.numel() == 0
    assert torch.equal(model.get_input_embeddings()(torch.tensor([[5, 17, 49151]])), embedded)
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 216, 33, 30, 12630, 17]])
    with torch.no_grad():
        got, expected = model(ids).logits.float(), reference(ids).logits
    # bf16 activations between layers: agreement at the scale of bf16 rounding.
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@needs_bf16
def test_a_k_quant_mix_computes_its_weights():
    """A Llama wide enough for K-quants (K a multiple of 256) written as llama.cpp's K-quant mixes
    write such models: attention and gate Q4_K, up projections Q5_K and Q5_1, a down projection
    Q6_K and one Q5_0 (what llama.cpp writes for Q4_K where K is not whole super-blocks), the
    tied embedding Q6_K. Every layer goes
    to the kernels, the embedding reads its rows from the head's Q6_K blocks, and the logits are
    the same de-quantized weights' in float32."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from replica.quant.gguf_weights import quantize_from_gguf
    from tests.engine.conftest import TINY

    torch.manual_seed(5)
    config = LlamaConfig(**{**TINY, "hidden_size": 256, "intermediate_size": 512})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    types = {
        "token_embd.weight": "Q6_K", "blk.0.ffn_down.weight": "Q6_K", "blk.1.ffn_down.weight": "Q5_0",
        "blk.0.ffn_up.weight": "Q5_K", "blk.1.ffn_up.weight": "Q5_1",
    }
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "mix.gguf"
        write_gguf(model, path, types, default="Q4_K")
        reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
        ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 216, 33, 30, 12630, 17]])
        embedded = model.get_input_embeddings()(ids)
        assert quantize_from_gguf(model, path) == 7 * config.num_hidden_layers + 1
    assert model.lm_head.weight.numel() == 0 and model.get_input_embeddings().weight.numel() == 0
    assert torch.equal(model.get_input_embeddings()(ids), embedded)
    with torch.no_grad():
        got, expected = model(ids).logits.float(), reference(ids).logits
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@needs_bf16
def test_unsupported_types_and_mismatched_tensors_are_refused_by_name(tiny_llama, tmp_path):
    """A linear layer of a type the kernels do not read, whose blocks stand for a NaN, or whose
    blocks are not the weight transformers loaded, stops the start and is named; a tied head of
    such a type stays dense."""
    from replica.quant.gguf_weights import quantize_from_gguf

    model = _tiny(tiny_llama)
    write_gguf(model, tmp_path / "fp4.gguf", {"blk.1.ffn_down.weight": "MXFP4"})
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_down\.weight \(model\.layers\.1\.mlp\.down_proj\) is MXFP4"):
        quantize_from_gguf(model, tmp_path / "fp4.gguf")
    model = _tiny(tiny_llama)
    write_gguf(model, tmp_path / "fp4-head.gguf", {"token_embd.weight": "MXFP4"})  # a tied head of another type
    assert quantize_from_gguf(model, tmp_path / "fp4-head.gguf") == 7 * model.config.num_hidden_layers
    assert model.lm_head.weight is model.get_input_embeddings().weight and model.lm_head.weight.numel() > 0
    model = _tiny(tiny_llama)
    write_gguf(model, tmp_path / "nan.gguf", {})
    data = bytearray((tmp_path / "nan.gguf").read_bytes())
    import gguf

    tensor = next(t for t in gguf.GGUFReader(str(tmp_path / "nan.gguf")).tensors if t.name == "blk.1.attn_k.weight")
    data[tensor.data_offset : tensor.data_offset + 2] = b"\x00\x7e"  # the first block's fp16 scale: NaN
    (tmp_path / "nan.gguf").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"blk\.1\.attn_k\.weight \(model\.layers\.1\.self_attn\.k_proj\) holds non-finite weights"):
        quantize_from_gguf(model, tmp_path / "nan.gguf")
    model = _tiny(tiny_llama)
    write_gguf(model, tmp_path / "unpermuted.gguf", {}, permute=False)  # rows not in llama.cpp's order
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight does not match model\.layers\.0\.self_attn\.q_proj"):
        quantize_from_gguf(model, tmp_path / "unpermuted.gguf")


def test_a_gguf_file_is_a_model_and_the_packaged_file_is_preferred():
    """``--model file.gguf`` converts the file once into a folder (config, tokenizer, weights); with
    quantization, the default id is served from its package's file even where a hub copy exists."""
    from replica.config.engine_config import DEFAULT_MODEL
    from replica.config.model_files import packaged_gguf_path, resolve_gguf_model, resolve_model_path

    path = str(packaged_gguf_path(DEFAULT_MODEL))
    folder, file = resolve_gguf_model(path)
    assert str(file) == path and resolve_model_path(path) == folder
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= {p.name for p in Path(folder).iterdir()}
    assert resolve_gguf_model(DEFAULT_MODEL)[1] == Path(path)
    with pytest.raises(ValueError, match="needs a GGUF model"):
        resolve_gguf_model("Qwen/Qwen2.5-0.5B")


def test_missing_empty_and_truncated_gguf_files_are_refused_by_name(tmp_path):
    from replica.config.engine_config import DEFAULT_MODEL
    from replica.config.model_files import packaged_gguf_path, resolve_gguf_model, resolve_model_path

    with pytest.raises(ValueError, match="no such GGUF file"):
        resolve_model_path(str(tmp_path / "nope.gguf"))
    (tmp_path / "empty.gguf").touch()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(packaged_gguf_path(DEFAULT_MODEL).read_bytes()[:1_000_000])
    with pytest.raises(ValueError, match=rf"{tmp_path / 'empty.gguf'}: not a GGUF file"):
        resolve_gguf_model(str(tmp_path / "empty.gguf"))
    with pytest.raises(ValueError, match=rf"{truncated}: not a GGUF model transformers can read"):
        resolve_gguf_model(str(truncated))


def test_quantization_needs_a_gguf_model_on_cpu(tiny_llama):
    from replica.config.engine_config import EngineConfig
    from replica.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="quantization gguf runs on device cpu"):
        EngineConfig(quantization="gguf", device="cuda")
    assert EngineConfig(quantization="gguf", tensor_parallel_size=2).tensor_parallel_size == 2  # each rank its part
    with pytest.raises(ValueError, match="Input should be 'gguf', 'int8', 'int4', 'compressed-tensors', 'awq' or 'gptq'"):
        EngineConfig(quantization="bitsandbytes")
    with pytest.raises(ValueError, match="bfloat16 or float32 activations, not float16"):
        EngineConfig(quantization="gguf", dtype="half")
    with pytest.raises(ValueError, match="needs a GGUF model"):
        LLMEngine(EngineConfig(model=tiny_llama, quantization="gguf", **ON_TEST_DEVICE))


# ---- the real default model, from its package's Q4_1 file -------------------------------------

CHATS = [
    *REAL_MODEL_CHATS,
    "Name three primary colors.",
    "Explain what a CPU does in one sentence.",
    "Write a Python function that adds two numbers.",
]
TOKENS = 32
TEXT = (
    "The Industrial Revolution began in Great Britain in the late eighteenth century and spread to "
    "continental Europe and North America during the nineteenth. Steam engines, mechanised spinning "
    "and new methods of making iron changed how goods were made, where people lived and how they "
    "worked. Cities grew quickly as workers left farms for factories, and railways cut the time it "
    "took to move people and goods from weeks to days.\n\n"
    "Water is made of two hydrogen atoms and one oxygen atom. At sea level it boils at one hundred "
    "degrees Celsius and freezes at zero. Because ice is less dense than liquid water, lakes freeze "
    "from the top down, and the ice on the surface keeps the water below from freezing solid, which "
    "lets fish survive the winter.\n\n"
    "To make a cup of tea, boil fresh water, warm the pot, and add one spoon of leaves for each cup. "
    "Pour the water over the leaves and let them steep for three to five minutes, then pour the tea "
    "through a strainer. Some people add milk or lemon; others drink it plain.\n\n"
    "def mean(values):\n"
    "    \"\"\"Return the arithmetic mean of a non-empty list of numbers.\"\"\"\n"
    "    if not values:\n"
    "        raise ValueError(\"mean of an empty list\")\n"
    "    return sum(values) / len(values)\n\n"
    "The planets of the solar system, in order from the Sun, are Mercury, Venus, Earth, Mars, "
    "Jupiter, Saturn, Uranus and Neptune. The four inner planets are small and rocky; the four "
    "outer ones are giants made mostly of gas and ice. Jupiter is the largest, with a mass more "
    "than twice that of all the other planets together."
)
# One pool for every engine here: 24 blocks of 16 tokens (the compiled decoder's graph depends on
# the pool's size, so engines with one pool share its compile). One request at a time fits (about
# 40 prompt tokens and 32 outputs; the perplexity text's 328 tokens); the eight chats at once do
# not, so batching them preempts by recompute.
POOL = dict(max_num_seqs=8, num_blocks=24, max_model_len=384, device=ON_TEST_DEVICE["device"])
SCENARIOS = {
    "batched-and-preempted": {},
    "chunked": dict(max_num_batched_tokens=16),
}


def _prompts(tokenizer) -> list[list[int]]:
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True, return_dict=False)
        for c in CHATS
    ]


@pytest.fixture(scope="module")
def quantized():
    """The default model served from its Q4_1 file, compiled, on the small pool (:data:`POOL`)."""
    with LLM(quantization="gguf", **POOL) as llm:
        yield llm


@pytest.fixture(scope="module")
def alone(quantized) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    outs = [quantized.generate(prompt_token_ids=[p], sampling_params=params)[0] for p in _prompts(quantized.tokenizer)]
    assert_idle(quantized.engine)
    return [o.outputs[0].token_ids for o in outs]


@needs_bf16
def test_the_default_model_is_computed_from_its_file(quantized):
    runner = quantized.engine.runner
    assert runner.num_quantized == 211  # 30 layers x 7 linears (Q4_1), the tied head (Q8_0)
    assert runner.model.model.layers[0].mlp.down_proj.weight.numel() == 0
    assert runner.model.get_input_embeddings().weight.numel() == 0  # its rows come from the head's blocks


@needs_bf16
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_alone_equals_batched_chunked_and_preempted(quantized, alone, scenario):
    """The eight chats at once, and again with prefill chunks of 16 tokens, give each the tokens
    it got alone (all compiled: in bf16, inductor's fused norms round otherwise than eager ones,
    so compiled and eager tokens may differ, on dense weights as on blocks)."""
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    llm = quantized if scenario == "batched-and-preempted" else LLM(quantization="gguf", **POOL, **SCENARIOS[scenario])
    try:
        preempted = llm.engine.scheduler.num_preemptions
        outs = llm.generate(prompt_token_ids=_prompts(llm.tokenizer), sampling_params=params)
        assert [o.outputs[0].token_ids for o in outs] == alone
        assert llm.engine.scheduler.num_preemptions > preempted
        assert_idle(llm.engine)
    finally:
        if llm is not quantized:
            llm.close()


@pytest.fixture(scope="module")
def reference(smollm2_path):
    """transformers in float32 on the weights the file's blocks stand for (the converted folder)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)


def teacher_forced(reference, prompts, outputs) -> tuple[int, list[float]]:
    """How many of the engine's greedy tokens float32 transformers also ranks first given the
    same prefix, and for the others the logprob gap from its first choice to the engine's token."""
    agree, gaps = 0, []
    with torch.no_grad():
        for prompt, tokens in zip(prompts, outputs):
            logprobs = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
            for row, token in zip(logprobs, tokens):
                if int(row.argmax()) == token:
                    agree += 1
                else:
                    gaps.append(round(float(row.max() - row[token]), 4))
    return agree, gaps


@needs_f32
def test_float32_greedy_tokens_are_transformers_own_on_the_same_weights(reference):
    """With float32 activations, the kernel's only difference from transformers on the
    de-quantized weights is the order of float32 sums: every greedy token is the one
    transformers picks after the same prefix (teacher-forced, 256 positions), so greedy
    generation gives the same tokens."""
    with LLM(quantization="gguf", dtype="float32", compile=False, max_num_seqs=8, **ON_TEST_DEVICE) as llm:
        prompts = _prompts(llm.tokenizer)
        params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
        assert llm.engine.runner.num_quantized == 211
        assert_idle(llm.engine)
    assert teacher_forced(reference, prompts, outputs) == (len(prompts) * TOKENS, [])


@needs_bf16
def test_bf16_greedy_tokens_differ_from_float32_only_at_near_ties(quantized, alone, reference, capsys):
    """bf16 activations (the served dtype) round every layer's input, as the dense bf16 engine
    does: teacher-forced against float32 transformers on the same weights, at least 95 % of the
    256 greedy tokens agree, and the others are near-ties for float32 (the gaps are printed; the
    dense bf16 engine's are in docs/bench/quantized-cpu.md)."""
    agree, gaps = teacher_forced(reference, _prompts(quantized.tokenizer), alone)
    with capsys.disabled():
        print(f"\n4-bit bf16 greedy vs float32: {agree}/{len(CHATS) * TOKENS} agree; logprob gaps where not: {gaps}")
    assert agree >= 0.95 * len(CHATS) * TOKENS
    assert all(gap < 0.35 for gap in gaps), gaps


@needs_bf16
def test_perplexity_is_within_one_percent_of_float32(quantized, reference):
    ids = quantized.tokenizer.encode(TEXT)
    [out] = quantized.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=0, prompt_logprobs=0))
    engine_nll = -sum(entry.logprob for entry in out.prompt_logprobs[1:]) / (len(ids) - 1)
    with torch.no_grad():
        logprobs = reference(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
    reference_nll = -float(logprobs.gather(1, torch.tensor(ids[1:])[:, None]).mean())
    assert abs(math.exp(engine_nll) / math.exp(reference_nll) - 1) <= 0.01, (math.exp(engine_nll), math.exp(reference_nll))
    assert_idle(quantized.engine)
