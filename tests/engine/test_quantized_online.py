"""``quantization: int8|int4``: a full-precision model's linear layers quantized at load into
blocks of 32 (Q8_0; Q4_1 with the output layer Q8_0) and computed by Carpool's block kernels.

* The blocks are those ggml's own quantizers write (the ``gguf`` package's copy of them), halves
  and all-equal blocks included.
* With float32 activations, the engine's greedy tokens are transformers' own on the weights the
  blocks stand for, and a real peft adapter on the 4-bit base gives peft's tokens on them; alone =
  batched = chunked = preempted on the 4-bit engine (compiled, bf16).
* Layers of partial blocks stay as loaded; non-finite block scales refuse the start by layer.
* The real default model in int4: its perplexity on a fixed text within 1 % of what float32
  transformers gives on the same blocks' weights.
"""

from __future__ import annotations

import math

import pytest
import torch

from replica import LLM, SamplingParams
from replica.kernels import cpu_kernels
from replica.quant.blocks import dequantize, quantize_q4_1, quantize_q8_0
from replica.quant.gguf_blocks import split_gguf_blocks
from tests.engine.test_quantized_gguf import TEXT
from tests.helpers import ON_TEST_DEVICE, assert_idle

HAS_BF16 = cpu_kernels.load() and cpu_kernels.has_block_gemv(torch.bfloat16)
HAS_F32 = cpu_kernels.available() and cpu_kernels.has_block_gemv(torch.float32)
needs_bf16 = pytest.mark.skipif(not HAS_BF16, reason="no block kernels on this CPU (they need AVX512F, or AVX2 with FMA and F16C)")
needs_f32 = pytest.mark.skipif(not HAS_F32, reason="no block kernels on this CPU (they need AVX512F, or AVX2 with FMA and F16C)")

QUANTIZERS = {"Q8_0": quantize_q8_0, "Q4_1": quantize_q4_1}


@pytest.mark.parametrize("type_name", QUANTIZERS)
def test_blocks_are_the_ones_ggml_writes(type_name):
    import gguf

    torch.manual_seed(0)
    weight = torch.randn(48, 96) * 0.05
    weight[0, :32] = 0  # an all-zero block: d = 0
    weight[1, :32] = 0.5  # all equal: Q4_1's d = 0
    weight[2, :32] = torch.arange(32) - 15.5  # halves after scaling (Q8_0: d = 16.5 / 127)
    weight[3, :5] = torch.tensor([127.0, 0.5, 1.5, -2.5, -0.5])  # Q8_0's d = 1: halves round away from zero
    got = QUANTIZERS[type_name](weight)
    expected = split_gguf_blocks(torch.from_numpy(gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType[type_name])), type_name)
    assert torch.equal(got.q, expected.q) and torch.equal(got.scales, expected.scales)
    assert (got.mins is None and expected.mins is None) or torch.equal(got.mins, expected.mins)
    assert (got.offset, got.bits) == (expected.offset, expected.bits)
    # Each weight is within half a step of its block's value (the minimum's fp16 rounding aside).
    step = got.scales.float().repeat_interleave(32, dim=1)
    assert ((dequantize(got) - weight).abs()[4:] <= step[4:] * 0.5 + 1e-3).all()


def test_rows_of_partial_blocks_are_refused():
    with pytest.raises(ValueError, match="whole 32-element blocks"):
        quantize_q4_1(torch.zeros(4, 40))
    with pytest.raises(ValueError, match="whole 32-element blocks"):
        quantize_q8_0(torch.zeros(40))


def _reference(path: str, scheme: str):
    """transformers in float32 on the weights the blocks stand for: every linear layer's weight
    replaced by its blocks' values (the tied embedding by the output layer's)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    head = model.get_output_embeddings()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.in_features % 32 == 0:
            quantize = quantize_q4_1 if scheme == "int4" and module is not head else quantize_q8_0
            module.weight.data = dequantize(quantize(module.weight.data))  # a tied embedding shares it
    return model


def _greedy(model, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    outs = []
    for ids in prompts:
        generated = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                   max_new_tokens=tokens, do_sample=False, pad_token_id=2)
        outs.append(generated[0, len(ids):].tolist())
    return outs


PROMPTS = [[1, 504, 3458, 282, 4649, 314, 216, 33, 30, 12630, 17], [5, 17, 49151, 900, 31], [7] * 40, list(range(100, 190))]


@needs_f32
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_float32_greedy_tokens_are_transformers_own_on_the_blocks_weights(tiny_llama, scheme):
    """Every linear layer of the tiny Llama (7 per layer and the tied head) on the kernels, the
    embedding reading its rows from the head's Q8_0 blocks; with float32 activations the tokens
    are transformers' on the blocks' weights (greedy, 24 tokens each, all prompts at once)."""
    with LLM(model=tiny_llama, quantization=scheme, dtype="float32", compile=False, max_num_seqs=4, **ON_TEST_DEVICE) as llm:
        runner = llm.engine.runner
        assert runner.num_quantized == 7 * runner.model.config.num_hidden_layers + 1
        assert runner.model.model.layers[0].mlp.down_proj.weight.numel() == 0
        assert runner.model.get_input_embeddings().weight.numel() == 0  # its rows come from the head's blocks
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)]
        assert_idle(llm.engine)
    assert got == _greedy(_reference(tiny_llama, scheme), PROMPTS, 24)


def assert_alone_equals_batched_chunked_and_preempted(quantized: int, **settings) -> None:
    """On an engine of ``settings`` (bf16, compiled) with ``quantized`` layers on blocks: each
    prompt's greedy tokens alone, then all at once in a pool small enough to preempt, then in
    prefill chunks of 8 tokens, are the same."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    pool = dict(max_num_seqs=4, num_blocks=14, max_model_len=192, **ON_TEST_DEVICE, **settings)
    with LLM(**pool) as llm:
        assert llm.engine.runner.num_quantized == quantized
        alone = [llm.generate(prompt_token_ids=[p], sampling_params=params)[0].outputs[0].token_ids for p in PROMPTS]
        together = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)]
        assert llm.engine.scheduler.num_preemptions > 0
        assert_idle(llm.engine)
    with LLM(**pool, max_num_batched_tokens=8) as llm:
        chunked = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)]
        assert_idle(llm.engine)
    assert together == alone and chunked == alone


@needs_bf16
def test_4_bit_alone_equals_batched_chunked_and_preempted(tiny_llama):
    """int4, bf16, compiled (:func:`assert_alone_equals_batched_chunked_and_preempted`)."""
    assert_alone_equals_batched_chunked_and_preempted(15, model=tiny_llama, quantization="int4")


@needs_f32
def test_lora_adapters_on_a_4_bit_base_give_peft_s_tokens_on_the_blocks_weights(tiny_llama, tmp_path):
    """QLoRA's arrangement: the base's layers on Q4_1 blocks, a real peft adapter's matrices dense
    (float32); the engine's greedy tokens equal peft's on the blocks' weights, with and without
    the adapter in one batch."""
    from tests.lora_adapters import make_adapter

    adapter = make_adapter(tiny_llama, tmp_path / "adapter", r=8, strength=0.5)
    base = tmp_path / "blocks-base"
    _reference(tiny_llama, "int4").save_pretrained(base)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(base)
    assert_lora_gives_peft_tokens(str(base), adapter, 7 * 2 + 1, model=tiny_llama, quantization="int4")


def assert_lora_gives_peft_tokens(reference: str, adapter, quantized: int, **settings) -> None:
    """On an engine of ``settings`` (float32, eager, LoRA on) with ``quantized`` layers on blocks:
    two prompts' greedy tokens with ``adapter`` and without, in one batch, equal peft's on
    ``reference`` (a plain checkpoint of the blocks' weights), and the adapter changes them."""
    from replica.protocol.lora_request import LoRARequest
    from tests.lora_adapters import peft_greedy

    with LLM(dtype="float32", compile=False, enable_lora=True, max_loras=1, max_lora_rank=8, max_num_seqs=4,
             **ON_TEST_DEVICE, **settings) as llm:
        assert llm.engine.runner.num_quantized == quantized
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        lora = LoRARequest("a", 1, adapter)
        outs = llm.generate(prompt_token_ids=PROMPTS[:2] * 2, sampling_params=params, lora_request=[lora, lora, None, None])
        got = [o.outputs[0].token_ids for o in outs]
        assert_idle(llm.engine)
    assert got[:2] == peft_greedy(reference, adapter, PROMPTS[:2], 16)
    assert got[2:] == peft_greedy(reference, None, PROMPTS[:2], 16)
    assert got[:2] != got[2:]  # the adapter changes the tokens


@needs_f32
def test_4_bit_shards_over_2_ranks_give_the_unsharded_blocks_tokens(tiny_llama):
    """tensor_parallel_size 2, int4, float32, eager: each rank quantizes its own shard (the
    row-wise layers' halves of K are whole blocks, so the blocks are the unsharded layer's); the
    greedy tokens are transformers' on the blocks' weights."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(model=tiny_llama, quantization="int4", dtype="float32", compile=False, tensor_parallel_size=2,
             max_num_seqs=4, num_blocks=64) as llm:
        runner = llm.engine.runner
        assert runner.tp.world_size == 2 and runner.num_quantized == 7 * runner.model.config.num_hidden_layers + 1
        assert runner.model.model.layers[0].mlp.down_proj.carpool_in_features == 64  # half of 128
        got = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)]
        assert_idle(llm.engine)
    assert got == _greedy(_reference(tiny_llama, "int4"), PROMPTS, 24)


def test_a_layer_of_partial_blocks_stays_as_loaded_and_bad_settings_are_refused():
    from replica.config.engine_config import EngineConfig
    from replica.quant.online import quantize_online

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.a, self.b, self.head = (torch.nn.Embedding(10, 64), torch.nn.Linear(64, 40),
                                                     torch.nn.Linear(40, 64), torch.nn.Linear(64, 10, bias=False))

        def get_input_embeddings(self):
            return self.embed

        def get_output_embeddings(self):
            return self.head

    model = Tiny()
    if HAS_F32:
        assert quantize_online(model, "int4") == 2  # a and head; b's 40 inputs are not whole blocks
        assert model.b.weight.numel() == 40 * 64 and model.a.weight.numel() == 0
        assert model.embed.weight.numel() == 640  # not tied: it stays
    with pytest.raises(ValueError, match="int8 or int4, not 'int2'"):
        quantize_online(model, "int2")
    huge = Tiny()
    huge.a.weight.data[3, 0] = 1e7  # d = 1e7 / 127: past fp16's largest finite value
    with pytest.raises(ValueError, match="layer a has a block whose scale or minimum is not finite"):
        quantize_online(huge, "int8")
    with pytest.raises(ValueError, match="Input should be 'gguf', 'int8', 'int4', 'compressed-tensors', 'awq' or 'gptq'"):
        EngineConfig(quantization="fp8")
    with pytest.raises(ValueError, match="quantization int4 runs on device cpu"):
        EngineConfig(quantization="int4", device="cuda")
    with pytest.raises(ValueError, match="quantization int8 computes with bfloat16 or float32 activations, not float16"):
        EngineConfig(quantization="int8", dtype="half")


@needs_bf16
def test_the_default_model_in_int4_keeps_its_perplexity(smollm2_path, capsys):
    """SmolLM2 in int4 (bf16 activations, eager): perplexity on a fixed text within 1 % of float32
    transformers on the blocks' weights; the perplexity of its own weights is printed beside (the
    default model's weights come from its Q4_1 file, so int4 finds about the same blocks again)."""
    from transformers import AutoModelForCausalLM

    with LLM(model=smollm2_path, quantization="int4", compile=False, max_num_seqs=1, **ON_TEST_DEVICE) as llm:
        assert llm.engine.runner.num_quantized == 211  # 30 layers x 7 (Q4_1) and the tied head (Q8_0)
        ids = llm.tokenizer.encode(TEXT)
        [out] = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=0, prompt_logprobs=0))
        engine = math.exp(-sum(entry.logprob for entry in out.prompt_logprobs[1:]) / (len(ids) - 1))
        assert_idle(llm.engine)

    def perplexity(model) -> float:
        with torch.no_grad():
            logprobs = model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
        return math.exp(-float(logprobs.gather(1, torch.tensor(ids[1:])[:, None]).mean()))

    blocks = perplexity(_reference(smollm2_path, "int4"))
    own = perplexity(AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32))
    with capsys.disabled():
        print(f"\nSmolLM2 perplexity: int4 engine (bf16) {engine:.4f}, its blocks in float32 {blocks:.4f}, its own weights {own:.4f}")
    assert abs(engine / blocks - 1) <= 0.01
