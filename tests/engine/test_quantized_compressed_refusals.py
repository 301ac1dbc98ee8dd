"""compressed-tensors ct_checkpoints (``replica/quant/compressed.py``, ``checkpoint.py``): what is
refused, by name, before the model loads or at start (other methods and schemes, settings that
do not fit the checkpoint, non-finite scales, malformed configs), and the layers no kernel takes,
de-quantized into plain layers that compile (W8A8's still quantizing their inputs per token), on
the tiny Llama written by ``tests/engine/compressed_files.py``."""

from __future__ import annotations

import pytest
import torch

from replica import LLM, SamplingParams
from tests.engine.test_quantized_online import PROMPTS, needs_f32
from tests.helpers import ON_TEST_DEVICE, assert_idle


@needs_f32
@pytest.mark.parametrize(("scheme", "said"), [
    ("fp8", r"config group group_0 \(targets Linear\) has weights float8 channel symmetric in format float-quantized"),
    ("w8a8-static", r"group_0 \(targets Linear\) quantizes its input activations as int8 tensor symmetric; Carpool computes"),
])
def test_unsupported_schemes_are_refused_by_config_group(ct_checkpoints, scheme, said):
    with pytest.raises(ValueError, match=said):
        LLM(model=ct_checkpoints(scheme), dtype="float32", compile=False, max_num_seqs=1, **ON_TEST_DEVICE)


@needs_f32
def test_settings_and_checkpoints_that_do_not_fit_are_refused_before_loading(ct_checkpoints, tiny_llama, tmp_path):
    """What ``carpool serve`` says before Ray (:func:`check_checkpoint`) and the engine at start."""
    import json
    import shutil

    from replica.config.engine_config import EngineConfig
    from replica.quant.checkpoint import check_checkpoint

    with pytest.raises(ValueError, match="compressed-tensors checkpoint: serve it with quantization compressed-tensors"):
        LLM(model=ct_checkpoints("w4a16"), quantization="int4", dtype="float32", compile=False, max_num_seqs=1, **ON_TEST_DEVICE)
    with pytest.raises(ValueError, match="needs a checkpoint whose config.json has a compressed-tensors"):
        LLM(model=tiny_llama, quantization="compressed-tensors", dtype="float32", compile=False, max_num_seqs=1, **ON_TEST_DEVICE)
    assert EngineConfig(quantization="compressed-tensors", tensor_parallel_size=2).tensor_parallel_size == 2  # each rank its part
    with pytest.raises(ValueError, match="quantizes its input activations per token \\(W8A8\\), which runs at tensor_parallel_size 1"):
        check_checkpoint(ct_checkpoints("w8a8"), None, 2)
    with pytest.raises(ValueError, match="config group group_0 \\(targets Linear\\) has weights float8"):
        check_checkpoint(ct_checkpoints("fp8"), None, 1)
    awq = shutil.copytree(tiny_llama, tmp_path / "awq")
    config = json.loads((awq / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (awq / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="is quantized by 'bitsandbytes', which Carpool does not serve yet"):
        check_checkpoint(str(awq), None, 1)
    check_checkpoint(ct_checkpoints("w8a8"), "compressed-tensors", 1)
    check_checkpoint(tiny_llama, "int4", 2)
    with pytest.raises(ValueError, match="SmolLM2-135M-Instruct has none"):  # the packaged default model
        check_checkpoint("HuggingFaceTB/SmolLM2-135M-Instruct", "compressed-tensors", 1)


@needs_f32
def test_a_hub_id_is_checked_from_the_hub_cache_or_where_it_loads(ct_checkpoints, tmp_path, monkeypatch):
    """A hub id whose config.json is in the hub's local cache is checked before loading as a
    folder is; one not cached is left to the replica (no network here)."""
    import shutil

    import huggingface_hub.constants

    from replica.quant.checkpoint import check_checkpoint

    snapshot = tmp_path / "models--acme--smol-w4a16" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    shutil.copy(f"{ct_checkpoints('w4a16')}/config.json", snapshot)
    (tmp_path / "models--acme--smol-w4a16" / "refs").mkdir()
    (tmp_path / "models--acme--smol-w4a16" / "refs" / "main").write_text("abc")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    check_checkpoint("acme/smol-w4a16", "compressed-tensors", 1)
    with pytest.raises(ValueError, match="compressed-tensors checkpoint: serve it with quantization compressed-tensors"):
        check_checkpoint("acme/smol-w4a16", "int4", 1)
    check_checkpoint("acme/not-cached", "compressed-tensors", 1)  # the replica checks it where it loads


def test_where_no_kernel_runs_the_checkpoint_is_de_quantized_at_load(ct_checkpoints):
    """float16 activations (no block kernel takes them) with ``quantization`` unset: the package
    de-quantizes every layer at load (its first-forward hook removed), and the model gives
    transformers' own logits."""
    from transformers import AutoModelForCausalLM

    from replica.worker.model_loader import quantize_linears

    path = ct_checkpoints("w8a16")
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
def test_layers_no_kernel_takes_compile_and_keep_their_int8_inputs(ct_checkpoints):
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
        with LLM(model=ct_checkpoints(scheme, scale_dtype=torch.float32), dtype="float32", compile=compiled, max_num_seqs=4,
                 **ON_TEST_DEVICE) as llm:
            assert llm.engine.runner.num_quantized == 0
            forward = llm.engine.runner.model.model.layers[0].mlp.down_proj.forward
            assert (getattr(forward, "__func__", None) is _w8a8_dense_forward) == (scheme == "w8a8")
            runs.append([o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)])
            assert_idle(llm.engine)
    assert runs[0] == runs[1] and all(len(tokens) == 12 for tokens in runs[2])
    path = ct_checkpoints("w8a8", scale_dtype=torch.float32)
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
def test_float16_serves_the_de_quantized_checkpoint_compiled(ct_checkpoints):
    """``dtype: float16`` (no block kernel takes it), ``quantization`` unset, compiled: the engine
    starts on the layers the package de-quantized and gives the eager engine's tokens."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = []
    for compiled in (False, True):
        with LLM(model=ct_checkpoints("w4a16"), dtype="float16", compile=compiled, max_num_seqs=4, **ON_TEST_DEVICE) as llm:
            assert llm.engine.runner.num_quantized == 0
            runs.append([o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS[:2], sampling_params=params)])
            assert_idle(llm.engine)
    assert runs[0] == runs[1]


@needs_f32
def test_a_non_finite_scale_and_a_malformed_config_are_refused(ct_checkpoints, tmp_path):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from replica.quant.checkpoint import check_checkpoint

    broken = shutil.copytree(ct_checkpoints("w8a16"), tmp_path / "nan")
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
                       "config group g \\(targets Embedding\\) quantizes embeddings"),
                      ({**config["quantization_config"], "config_groups": {"g": {"targets": ["re:.*embed_tokens$"], "weights": {"num_bits": 4}}}},
                       "quantizes embeddings")]:
        (broken / "config.json").write_text(json.dumps({**config, "quantization_config": bad}))
        with pytest.raises(ValueError, match=said):
            check_checkpoint(str(broken), None, 1)


@needs_f32
def test_a_quantized_tied_output_layer_is_refused_before_loading(ct_checkpoints, tiny_llama, tmp_path):
    """The tiny Llama ties its output layer to its input embeddings; a recipe that does not ignore
    ``lm_head`` packs it, which transformers cannot load (its tied weight is ``lm_head.weight``):
    refused by config group, before loading, and served once ``lm_head`` is ignored."""
    from replica.quant.checkpoint import check_checkpoint
    from tests.engine.compressed_files import write_compressed

    tied = write_compressed(tiny_llama, tmp_path / "tied", "w8a16", ignore=())
    with pytest.raises(ValueError, match="quantizes lm_head, which this model ties to its input embeddings"):
        check_checkpoint(str(tied), None, 1)
    with pytest.raises(ValueError, match="quantizes lm_head"):
        LLM(model=str(tied), dtype="float32", compile=False, max_num_seqs=1, **ON_TEST_DEVICE)
    check_checkpoint(ct_checkpoints("w8a16"), None, 1)  # lm_head ignored
