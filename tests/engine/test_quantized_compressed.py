"""``quantization: compressed-tensors``: a checkpoint written by the ``compressed-tensors`` package
(W4A16, W8A16, W8A8 int8) computed from its integer weights on Carpool's block kernels.

* The reference is transformers itself loading the same checkpoint (the package de-quantizes
  each layer on the first forward and, for W8A8, quantizes each token's input): with float32
  activations, the engine's greedy tokens are its own (W8A8: teacher-forced top-1 agreement of
  at least 99 %, the logprob gaps of any flip shown).
* Alone = batched = chunked = preempted on the 4-bit engine (bf16, compiled).
* Each scheme takes the kernel path it should (4-bit nibbles, 8-bit bytes, or de-quantized where
  the kernels would not be exact: float32 scales); refusals and those de-quantized layers are
  ``test_quantized_compressed_refusals.py``'s.
* The CUDA path's int4 layout (tinygemm), through torch's CPU twin of its kernel.
* The default model in W4A16: perplexity within 1 % of transformers' on the same checkpoint.
"""

from __future__ import annotations

import math

import pytest
import torch

from replica import LLM, SamplingParams
from tests.engine.compressed_files import write_compressed
from tests.engine.test_quantized_gguf import TEXT
from tests.engine.test_quantized_online import (
    PROMPTS,
    _greedy,
    assert_alone_equals_batched_chunked_and_preempted,
    needs_bf16,
    needs_f32,
)
from tests.helpers import ON_TEST_DEVICE, assert_idle



def _transformers(path: str):
    """transformers on the checkpoint (the package de-quantizes it on the first forward); packed
    zero points, which transformers does not load, read from the files by Carpool's loader."""
    from replica.worker.model_loader import _from_pretrained

    return _from_pretrained(path, torch.float32, "sdpa")


def _engine_tokens(path: str, tokens: int, **kwargs) -> tuple[list[list[int]], int]:
    with LLM(model=path, dtype="float32", compile=False, max_num_seqs=4, **ON_TEST_DEVICE, **kwargs) as llm:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)]
        quantized = llm.engine.runner.num_quantized
        layer = llm.engine.runner.model.model.layers[0].mlp.down_proj
        assert not hasattr(layer, "weight_packed") and layer.weight.numel() in (0, layer.in_features * layer.out_features)
        assert_idle(llm.engine)
    return got, quantized


@needs_f32
@pytest.mark.parametrize(("scheme", "scale_dtype"), [
    ("w4a16", None), ("w4a16-channel", None), ("w8a16", None), ("w4a16-asym-naive", None),
    ("w4a16-asym-naive", torch.float16), ("w4a16-asym", torch.float16),
])
def test_float32_greedy_tokens_are_transformers_own_on_the_checkpoint(ct_checkpoints, scheme, scale_dtype):
    """Weights alone: 7 linear layers per layer on the kernels (the head is left dense, as
    llm-compressor's recipes leave it); greedy tokens equal transformers' on the same checkpoint
    (``quantization`` unset: inferred from its config, as vLLM does). Zero points, stored a byte a
    value or packed (whose zero points transformers does not load: Carpool reads them), with bf16
    or fp16 scales: nibbles under the group's scale and minimum."""
    path = ct_checkpoints(scheme, scale_dtype=scale_dtype)
    got, quantized = _engine_tokens(path, 24)
    assert quantized == 7 * 2
    assert got == _greedy(_transformers(path), PROMPTS, 24)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tokens_are_quantized_as_the_package_quantizes_them(dtype):
    """``quantize_tokens`` against the package's own dynamic per-token int8 rule, bit for bit:
    ordinary rows, an outlier row, an all-zero row, halves that round to even."""
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    from replica.quant.compressed import quantize_tokens
    from tests.engine.compressed_files import scheme_args

    args = scheme_args("w8a8")[1]
    torch.manual_seed(0)
    x = torch.randn(1, 6, 96, dtype=dtype)
    x[0, 2] *= 300
    x[0, 3] = 0
    x[0, 4, :4] = torch.tensor([127.5, -127.5, 0.5, 1.5])  # s = 1: halves
    q, scale = quantize_tokens(x)
    want_scale, zero = compute_dynamic_scales_and_zp(value=x, args=args, module=torch.nn.Linear(96, 8))
    assert torch.equal(scale, want_scale) and torch.equal(q, quantize(x, want_scale, zero, args))
    assert q.dtype == dtype and q.abs().max() <= 128


@needs_f32
def test_w8a8_layers_quantize_each_token_s_input_as_the_package_does(ct_checkpoints):
    """Every W8A8 layer (int8 weights, int8 inputs per token, dynamic), on inputs with an outlier
    token, gives the package's own output up to float32 rounding."""
    from replica.quant.compressed import quantize_from_compressed

    path = ct_checkpoints("w8a8")
    reference, model = _transformers(path), _transformers(path)
    with torch.no_grad():
        reference(torch.tensor([[1, 2, 3]]))  # the package de-quantizes its layers on the first forward
    assert quantize_from_compressed(model, torch.float32) == 14
    torch.manual_seed(0)
    for name, layer in model.named_modules():
        if hasattr(layer, "carpool_q_weight"):
            x = torch.randn(1, 6, layer.in_features)
            x[0, 2] *= 50
            with torch.no_grad():
                want, got = reference.get_submodule(name)(x), layer(x)
            assert (got - want).abs().max() <= 1e-5 * want.abs().max(), name


@needs_f32
def test_w8a8_top_1_agrees_with_transformers_along_its_own_tokens(ct_checkpoints):
    """W8A8 end to end, float32: along transformers' greedy continuations of 16 random prompts (64
    tokens each), the engine's top-1 (teacher-forced: prompt logprobs) is transformers' token at
    least 99 % of the time; transformers' logprob gaps at the flips are printed and small. Exact
    greedy equality is not a property of W8A8: each token's int8 rounding turns float32's last-bit
    differences into whole steps (the package's own model, its input embeddings moved by one part
    in 1e7, agrees with itself less often; printed beside)."""
    path = ct_checkpoints("w8a8")
    reference = _transformers(path)
    torch.manual_seed(5)
    prompts = [torch.randint(0, 49152, (int(n),)).tolist() for n in torch.randint(3, 60, (16,))]
    expected = _greedy(reference, prompts, 64)
    sequences = [prompt + want for prompt, want in zip(prompts, expected)]
    with LLM(model=path, quantization="compressed-tensors", dtype="float32", compile=False, max_num_seqs=4,
             num_blocks=128, **ON_TEST_DEVICE) as llm:
        assert llm.engine.runner.num_quantized == 7 * 2
        outs = llm.generate(prompt_token_ids=sequences, sampling_params=SamplingParams(max_tokens=0, prompt_logprobs=1))
        assert_idle(llm.engine)
    agree = moved = 0
    gaps = []
    torch.manual_seed(1)
    for prompt, want, out in zip(prompts, expected, outs):
        tops = [entry.top[0][0] for entry in out.prompt_logprobs[len(prompt):]]
        with torch.no_grad():
            embeds = reference.model.embed_tokens(torch.tensor([prompt + want]))
            logprobs = reference(inputs_embeds=embeds).logits[0, len(prompt) - 1:-1].log_softmax(-1)
            nudged = reference(inputs_embeds=embeds * (1 + 1e-7 * torch.randn_like(embeds))).logits[0, len(prompt) - 1:-1]
        moved += sum(w == int(top) for w, top in zip(want, nudged.argmax(-1)))
        for i, (w, top) in enumerate(zip(want, tops)):
            agree += w == top
            if w != top:
                gaps.append(round(float(logprobs[i, w] - logprobs[i, top]), 4))
    total = sum(len(want) for want in expected)
    print(f"\nW8A8 teacher-forced top-1: engine {agree}/{total}, transformers nudged by 1e-7 {moved}/{total}; "
          f"logprob gaps at the engine's flips {gaps}")
    assert agree >= 0.99 * total and all(abs(gap) < 0.5 for gap in gaps)


@needs_bf16
def test_4_bit_alone_equals_batched_chunked_and_preempted(ct_checkpoints):
    """W4A16, bf16, compiled (``assert_alone_equals_batched_chunked_and_preempted``)."""
    assert_alone_equals_batched_chunked_and_preempted(14, model=ct_checkpoints("w4a16"))


@needs_f32
def test_each_scheme_takes_its_kernel_path(ct_checkpoints):
    """int4 symmetric: nibbles (offset 8); int4 with zero points: nibbles with an integer minimum
    per block under the group's scale (K-quant form); int8: bytes; float32 scales that fp16 does not
    hold: de-quantized by the package, served as transformers serves them."""
    from transformers import AutoModelForCausalLM

    from replica.quant.compressed import quantize_from_compressed

    def layer_after(path: str):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        count = quantize_from_compressed(model, torch.float32)
        return count, model.model.layers[0].mlp.down_proj

    count, layer = layer_after(ct_checkpoints("w4a16"))
    assert count == 14 and layer.carpool_q_offset == 8 and layer.carpool_q_weight.shape[-1] == 2 and layer.carpool_q_mins is None
    for scale_dtype in (None, torch.float16):
        count, layer = layer_after(ct_checkpoints("w4a16-asym-naive", scale_dtype=scale_dtype))
        assert count == 14 and layer.carpool_q_offset == 0 and layer.carpool_q_weight.shape[-1] == 2
        assert layer.carpool_q_super_mins is not None and layer.carpool_q_super_scales.shape == (4, 4, 16)  # [G, K / 32, 16]
    count, layer = layer_after(ct_checkpoints("w8a16"))
    assert count == 14 and layer.carpool_q_offset == 128 and layer.carpool_q_weight.shape[-2:] == (16, 2)
    count, layer = layer_after(ct_checkpoints("w8a16", scale_dtype=torch.float32))
    assert count == 0 and layer.weight.shape == (64, 128) and not hasattr(layer, "carpool_q_weight")
    got, quantized = _engine_tokens(ct_checkpoints("w8a16", scale_dtype=torch.float32), 12)
    assert quantized == 0 and got == _greedy(_transformers(ct_checkpoints("w8a16", scale_dtype=torch.float32)), PROMPTS, 12)


@needs_bf16
def test_the_default_model_in_w4a16_keeps_transformers_perplexity(smollm2_path, tmp_path, capsys):
    """SmolLM2 written as W4A16 (groups of 64: its 576 inputs are not whole groups of 128), bf16
    activations, eager: perplexity on a fixed text within 1 % of transformers' (float32) on the
    same checkpoint."""
    path = write_compressed(smollm2_path, tmp_path / "smollm2-w4a16", "w4a16", group_size=64)
    with LLM(model=str(path), compile=False, max_num_seqs=1, **ON_TEST_DEVICE) as llm:
        assert llm.engine.runner.num_quantized == 210  # 30 layers x 7; the tied head stays bf16
        ids = llm.tokenizer.encode(TEXT)
        [out] = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=0, prompt_logprobs=0))
        engine = math.exp(-sum(entry.logprob for entry in out.prompt_logprobs[1:]) / (len(ids) - 1))
        assert_idle(llm.engine)
    with torch.no_grad():
        logprobs = _transformers(str(path))(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
    reference = math.exp(-float(logprobs.gather(1, torch.tensor(ids[1:])[:, None]).mean()))
    with capsys.disabled():
        print(f"\nSmolLM2 W4A16 perplexity: engine (bf16) {engine:.4f}, transformers on the checkpoint (float32) {reference:.4f}")
    assert abs(engine / reference - 1) <= 0.01


@pytest.mark.parametrize("scheme", ["w4a16", "w4a16-channel"])
def test_the_cuda_int4_layout_gives_the_package_s_weights(ct_checkpoints, scheme):
    """The CUDA path (tinygemm, ``replica/quant/tinygemm.py``) checked here through torch's CPU twin
    of the kernel, which takes the same scales-and-zeros layout and groups: every W4A16 layer of
    the bf16 model gives ``x @ W.T`` on the package's de-quantized weights (float32), up to bf16
    rounding. On a CUDA test device (the device check) the layers run on CUDA's own kernel, its
    byte packing included."""
    from transformers import AutoModelForCausalLM

    from replica.quant.compressed import _to_tinygemm

    path = ct_checkpoints(scheme)
    reference = _transformers(path)
    with torch.no_grad():
        reference(torch.tensor([[1, 2, 3]]))  # de-quantized on the first forward
    device = ON_TEST_DEVICE.get("device", "cpu")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device)
    layers = [(name, m) for name, m in model.named_modules() if getattr(m, "quantization_scheme", None) is not None]
    assert len(layers) == 14 and all(_to_tinygemm(m, torch.bfloat16) for _, m in layers)
    torch.manual_seed(0)
    for name, layer in layers:
        x = torch.randn(1, 5, layer.in_features).bfloat16()
        with torch.no_grad():
            want, got = reference.get_submodule(name)(x.float()), layer(x.to(device)).float().cpu()
        assert got.shape == want.shape and (got - want).abs().max() <= 0.02 * want.abs().max(), name
