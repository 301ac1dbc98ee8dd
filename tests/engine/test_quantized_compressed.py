"""``quantization: compressed-tensors``: a checkpoint written by the ``compressed-tensors`` package
(W4A16, W8A16, W8A8 int8) computed from its integer weights on Carpool's block kernels.

* The reference is transformers itself loading the same checkpoint (the package de-quantizes
  each layer on the first forward and, for W8A8, quantizes each token's input): with float32
  activations, the engine's greedy tokens are its own (W8A8: teacher-forced top-1 agreement of
  at least 99 %, the logprob gaps of any flip shown).
* Alone = batched = chunked = preempted on the 4-bit engine (bf16, compiled).
* Each scheme takes the kernel path it should (4-bit nibbles, 8-bit bytes, or de-quantized where
  the kernels would not be exact: float32 scales); unsupported schemes, and settings that do not
  fit the checkpoint, are refused at start by name.
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

@pytest.fixture(scope="module")
def checkpoints(tiny_llama, tmp_path_factory):
    """``get(scheme, **kwargs) -> folder``: the tiny Llama written in that scheme, once per module."""
    made: dict[tuple, str] = {}

    def get(scheme: str, **kwargs) -> str:
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        key = (scheme, *sorted(kwargs.items(), key=str))
        if key not in made:
            made[key] = str(write_compressed(tiny_llama, tmp_path_factory.mktemp(scheme), scheme, **kwargs))
        return made[key]

    return get


def _transformers(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


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
    ("w4a16-asym-naive", torch.float16),
])
def test_float32_greedy_tokens_are_transformers_own_on_the_checkpoint(checkpoints, scheme, scale_dtype):
    """Weights alone: 7 linear layers per layer on the kernels (the head is left dense, as
    llm-compressor's recipes leave it); greedy tokens equal transformers' on the same checkpoint
    (``quantization`` unset: inferred from its config, as vLLM does). Zero points: nibbles with a
    minimum per block (bf16 scales), or bytes of ``q - z`` (fp16 scales, whose ``-s * z`` fp16
    does not hold)."""
    path = checkpoints(scheme, scale_dtype=scale_dtype)
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
def test_w8a8_layers_quantize_each_token_s_input_as_the_package_does(checkpoints):
    """Every W8A8 layer (int8 weights, int8 inputs per token, dynamic), on inputs with an outlier
    token, gives the package's own output up to float32 rounding."""
    from replica.quant.compressed import quantize_from_compressed

    path = checkpoints("w8a8")
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
def test_w8a8_top_1_agrees_with_transformers_along_its_own_tokens(checkpoints):
    """W8A8 end to end, float32: along transformers' greedy continuations of 16 random prompts (64
    tokens each), the engine's top-1 (teacher-forced: prompt logprobs) is transformers' token at
    least 99 % of the time; transformers' logprob gaps at the flips are printed and small. Exact
    greedy equality is not a property of W8A8: each token's int8 rounding turns float32's last-bit
    differences into whole steps (the package's own model, its input embeddings moved by one part
    in 1e7, agrees with itself less often; printed beside)."""
    path = checkpoints("w8a8")
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
def test_4_bit_alone_equals_batched_chunked_and_preempted(checkpoints):
    """W4A16, bf16, compiled (``assert_alone_equals_batched_chunked_and_preempted``)."""
    assert_alone_equals_batched_chunked_and_preempted(14, model=checkpoints("w4a16"))


@needs_f32
def test_each_scheme_takes_its_kernel_path(checkpoints):
    """int4 symmetric: nibbles (offset 8); int4 with zero points: nibbles with a minimum per block
    where ``-s * z`` is exact in fp16 (bf16 scales), else bytes (fp16 scales); int8: bytes; float32 scales that fp16 does not
    hold: de-quantized by the package, served as transformers serves them."""
    from transformers import AutoModelForCausalLM

    from replica.quant.compressed import quantize_from_compressed

    def layer_after(path: str):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        count = quantize_from_compressed(model, torch.float32)
        return count, model.model.layers[0].mlp.down_proj

    count, layer = layer_after(checkpoints("w4a16"))
    assert count == 14 and layer.carpool_q_offset == 8 and layer.carpool_q_weight.shape[-1] == 2 and layer.carpool_q_mins is None
    count, layer = layer_after(checkpoints("w4a16-asym-naive"))
    assert count == 14 and layer.carpool_q_offset == 8 and layer.carpool_q_mins is not None
    count, layer = layer_after(checkpoints("w4a16-asym-naive", scale_dtype=torch.float16))
    assert count == 14 and layer.carpool_q_offset == 128 and layer.carpool_q_weight.shape[-2:] == (16, 2)
    count, layer = layer_after(checkpoints("w8a16"))
    assert count == 14 and layer.carpool_q_offset == 128 and layer.carpool_q_weight.shape[-2:] == (16, 2)
    count, layer = layer_after(checkpoints("w8a16", scale_dtype=torch.float32))
    assert count == 0 and layer.weight.shape == (64, 128) and not hasattr(layer, "carpool_q_weight")
    got, quantized = _engine_tokens(checkpoints("w8a16", scale_dtype=torch.float32), 12)
    assert quantized == 0 and got == _greedy(_transformers(checkpoints("w8a16", scale_dtype=torch.float32)), PROMPTS, 12)


@needs_f32
@pytest.mark.parametrize(("scheme", "said"), [
    ("fp8", r"config group group_0 \(targets Linear\) has weights float8 channel symmetric in format float-quantized"),
    ("w8a8-static", r"group_0 \(targets Linear\) quantizes its input activations as int8 tensor symmetric; Carpool computes"),
])
def test_unsupported_schemes_are_refused_by_config_group(checkpoints, scheme, said):
    with pytest.raises(ValueError, match=said):
        LLM(model=checkpoints(scheme), dtype="float32", compile=False, max_num_seqs=1, **ON_TEST_DEVICE)


@needs_f32
def test_settings_and_checkpoints_that_do_not_fit_are_refused_before_loading(checkpoints, tiny_llama, tmp_path):
    """What ``carpool serve`` says before Ray (:func:`check_checkpoint`) and the engine at start."""
    import json
    import shutil

    from replica.config.engine_config import EngineConfig
    from replica.quant.checkpoint import check_checkpoint

    with pytest.raises(ValueError, match="compressed-tensors checkpoint: serve it with quantization compressed-tensors"):
        LLM(model=checkpoints("w4a16"), quantization="int4", dtype="float32", compile=False, max_num_seqs=1, **ON_TEST_DEVICE)
    with pytest.raises(ValueError, match="needs a checkpoint whose config.json has a compressed-tensors"):
        LLM(model=tiny_llama, quantization="compressed-tensors", dtype="float32", compile=False, max_num_seqs=1, **ON_TEST_DEVICE)
    with pytest.raises(ValueError, match="config group group_0 \\(targets Linear\\) has asymmetric pack-quantized weights"):
        LLM(model=checkpoints("w4a16-asym"), dtype="float32", compile=False, max_num_seqs=1, **ON_TEST_DEVICE)
    with pytest.raises(ValueError, match="quantization compressed-tensors runs at tensor_parallel_size 1"):
        EngineConfig(quantization="compressed-tensors", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="checkpoint runs at tensor_parallel_size 1 for now"):
        check_checkpoint(checkpoints("w4a16"), None, 2)
    with pytest.raises(ValueError, match="config group group_0 \\(targets Linear\\) has weights float8"):
        check_checkpoint(checkpoints("fp8"), None, 1)
    awq = shutil.copytree(tiny_llama, tmp_path / "awq")
    config = json.loads((awq / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (awq / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="is quantized by 'awq', which Carpool does not serve yet"):
        check_checkpoint(str(awq), None, 1)
    check_checkpoint(checkpoints("w8a8"), "compressed-tensors", 1)
    check_checkpoint(tiny_llama, "int4", 2)
    with pytest.raises(ValueError, match="SmolLM2-135M-Instruct has none"):  # the packaged default model
        check_checkpoint("HuggingFaceTB/SmolLM2-135M-Instruct", "compressed-tensors", 1)


@needs_f32
def test_a_hub_id_is_checked_from_the_hub_cache_or_where_it_loads(checkpoints, tmp_path, monkeypatch):
    """A hub id whose config.json is in the hub's local cache is checked before loading as a
    folder is; one not cached is left to the replica (no network here)."""
    import shutil

    import huggingface_hub.constants

    from replica.quant.checkpoint import check_checkpoint

    snapshot = tmp_path / "models--acme--smol-w4a16" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    shutil.copy(f"{checkpoints('w4a16')}/config.json", snapshot)
    (tmp_path / "models--acme--smol-w4a16" / "refs").mkdir()
    (tmp_path / "models--acme--smol-w4a16" / "refs" / "main").write_text("abc")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    check_checkpoint("acme/smol-w4a16", "compressed-tensors", 1)
    with pytest.raises(ValueError, match="compressed-tensors checkpoint: serve it with quantization compressed-tensors"):
        check_checkpoint("acme/smol-w4a16", "int4", 1)
    check_checkpoint("acme/not-cached", "compressed-tensors", 1)  # the replica checks it where it loads


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
def test_the_cuda_int4_layout_gives_the_package_s_weights(checkpoints, scheme):
    """The CUDA path (tinygemm, ``replica/quant/tinygemm.py``) checked here through torch's CPU twin
    of the kernel, which takes the same scales-and-zeros layout and groups: every W4A16 layer of
    the bf16 model gives ``x @ W.T`` on the package's de-quantized weights (float32), up to bf16
    rounding. On a CUDA test device (the device check) the layers run on CUDA's own kernel, its
    byte packing included."""
    from transformers import AutoModelForCausalLM

    from replica.quant.compressed import _to_tinygemm

    path = checkpoints(scheme)
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


def test_where_no_kernel_runs_the_checkpoint_is_de_quantized_at_load(checkpoints):
    """float16 activations (no block kernel takes them) with ``quantization`` unset: the package
    de-quantizes every layer at load (its first-forward hook removed), and the model gives
    transformers' own logits."""
    from transformers import AutoModelForCausalLM

    from replica.worker.model_loader import quantize_linears

    path = checkpoints("w8a16")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16)
    assert quantize_linears(model, torch.float16) == 0
    layer = model.model.layers[0].mlp.down_proj
    assert layer.weight.shape == (64, 128) and not hasattr(layer, "weight_packed") and not hasattr(model, "ct_decompress_hook")
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16)
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    with pytest.raises(ValueError, match="computes with bfloat16 or float32 activations, not torch.float16"):
        quantize_linears(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16), torch.float16, scheme="compressed-tensors")


@needs_f32
def test_layers_no_kernel_takes_compile_and_keep_their_int8_inputs(checkpoints):
    """Float32 scales (fp16 does not hold them): every layer de-quantized into a plain layer, W8A8's
    still quantizing its inputs per token; compiled, the engine starts (W8A16: with the eager
    engine's tokens; W8A8's per-token rounding turns compiled float32's last bits into other
    tokens, so only its start and its blocks are checked). In bf16 the prepacking leaves W8A8's
    forward alone, and each such layer gives the package's own output."""
    from transformers import AutoModelForCausalLM

    from replica.quant.compressed import _w8a8_dense_forward, decompress_all
    from replica.worker.compilation import prepack_linears

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs = []
    for scheme, compiled in (("w8a16", False), ("w8a16", True), ("w8a8", True)):
        with LLM(model=checkpoints(scheme, scale_dtype=torch.float32), dtype="float32", compile=compiled, max_num_seqs=4,
                 **ON_TEST_DEVICE) as llm:
            assert llm.engine.runner.num_quantized == 0
            forward = llm.engine.runner.model.model.layers[0].mlp.down_proj.forward
            assert (getattr(forward, "__func__", None) is _w8a8_dense_forward) == (scheme == "w8a8")
            runs.append([o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)])
            assert_idle(llm.engine)
    assert runs[0] == runs[1] and all(len(tokens) == 12 for tokens in runs[2])
    path = checkpoints("w8a8", scale_dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    with torch.no_grad():
        reference(torch.tensor([[1, 2, 3]]))  # the package de-quantizes on the first forward
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    decompress_all(model)
    prepack_linears(model)
    layer = model.model.layers[0].mlp.down_proj
    assert layer.forward.__func__ is _w8a8_dense_forward
    x = torch.randn(1, 5, layer.in_features).bfloat16()
    with torch.no_grad():
        assert torch.equal(layer(x), reference.model.layers[0].mlp.down_proj(x))


@needs_f32
def test_float16_serves_the_de_quantized_checkpoint_compiled(checkpoints):
    """``dtype: float16`` (no block kernel takes it), ``quantization`` unset, compiled: the engine
    starts on the layers the package de-quantized and gives the eager engine's tokens."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = []
    for compiled in (False, True):
        with LLM(model=checkpoints("w4a16"), dtype="float16", compile=compiled, max_num_seqs=4, **ON_TEST_DEVICE) as llm:
            assert llm.engine.runner.num_quantized == 0
            runs.append([o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS[:2], sampling_params=params)])
            assert_idle(llm.engine)
    assert runs[0] == runs[1]


@needs_f32
def test_a_non_finite_scale_and_a_malformed_config_are_refused(checkpoints, tmp_path):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from replica.quant.checkpoint import check_checkpoint

    broken = shutil.copytree(checkpoints("w8a16"), tmp_path / "nan")
    tensors = load_file(broken / "model.safetensors")
    tensors["model.layers.1.self_attn.o_proj.weight_scale"][3, 0] = float("nan")
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    for dtype in ("float32", "float16"):  # on the kernels; de-quantized
        with pytest.raises(ValueError, match="layer model.layers.1.self_attn.o_proj has a weight scale that is not finite"):
            LLM(model=str(broken), dtype=dtype, compile=False, max_num_seqs=1, **ON_TEST_DEVICE)
    config = json.loads((broken / "config.json").read_text())
    for bad, said in [("compressed-tensors", "quantization_config is 'compressed-tensors', not an object"),
                      ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "does not read as one \\(config_groups: Field required"),
                      ({**config["quantization_config"], "config_groups": {"g": {"targets": ["Embedding"], "weights": {"num_bits": 4}}}},
                       "config group g \\(targets Embedding\\) quantizes embeddings")]:
        (broken / "config.json").write_text(json.dumps({**config, "quantization_config": bad}))
        with pytest.raises(ValueError, match=said):
            check_checkpoint(str(broken), None, 1)
