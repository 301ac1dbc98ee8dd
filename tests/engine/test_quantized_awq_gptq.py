"""``quantization: awq`` and ``gptq``: AutoAWQ (4-bit GEMM) and GPTQ (4 and 8 bits, ``gptq`` and
``gptq_v2``, symmetric or with zero points) checkpoints, converted once into compressed-tensors
(``replica/quant/convert.py``) and computed on the block kernels, on the tiny Llama written by
``tests/engine/awq_gptq_files.py`` from integers it chose:

* the converted checkpoint, loaded and de-quantized by the package, is exactly the writer's
  weights ``s * (q - z)``; the engine's greedy tokens (float32) are transformers' own on them;
* alone = batched = chunked = preempted on AWQ and act-order GPTQ engines (bf16, compiled);
* the default model in AWQ keeps transformers' perplexity (1 %) on the same weights;
* GPTQ in activation order: inputs sorted by group, each layer's input gathered in that order;
  LoRA adapters on such a base give peft's tokens on its weights;
* refusals, by name: other bit widths and packings, per-module overrides, settings that do not
  fit, a layer without its zero points.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from replica import LLM, SamplingParams
from tests.engine.awq_gptq_files import write_awq, write_gptq
from tests.engine.test_quantized_gguf import TEXT
from tests.engine.test_quantized_online import (
    PROMPTS,
    _greedy,
    assert_alone_equals_batched_chunked_and_preempted,
    assert_lora_gives_peft_tokens,
    needs_bf16,
    needs_f32,
)
from tests.helpers import ON_TEST_DEVICE, assert_idle

VARIANTS = {  # name -> (writer, kwargs, the first down_proj's kernel form: offset, K-quant minimums)
    "awq": (write_awq, {}, 0, True),
    "gptq-4-sym": (write_gptq, {}, 8, False),
    "gptq-4-zero-points": (write_gptq, {"sym": False}, 0, True),
    "gptq-4-v2-channel": (write_gptq, {"sym": False, "group_size": -1, "checkpoint_format": "gptq_v2"}, 0, True),
    "gptq-8-sym": (write_gptq, {"bits": 8, "group_size": 64}, 128, False),
    "gptq-4-act-order": (write_gptq, {"sym": False, "desc_act": True}, 0, True),
}


@pytest.fixture(scope="module")
def written(tiny_llama, tmp_path_factory):
    """``get(variant) -> (quantized, reference)`` folders, written once per module."""
    made: dict[str, tuple[Path, Path]] = {}

    def get(variant: str) -> tuple[Path, Path]:
        if variant not in made:
            writer, kwargs, *_ = VARIANTS[variant]
            made[variant] = writer(tiny_llama, tmp_path_factory.mktemp(variant), **kwargs)
        return made[variant]

    return get


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CARPOOL_CACHE_DIR", str(tmp_path / "cache"))


@needs_f32
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_converted_weights_are_the_checkpoint_s_and_greedy_tokens_transformers_own(written, variant):
    from transformers import AutoModelForCausalLM

    from replica.config.engine_config import cache_dir
    from replica.quant.compressed import decompress_all
    from replica.quant.convert import as_compressed
    from replica.worker.model_loader import _from_pretrained

    from replica.quant.convert import _fingerprint

    quantized, reference = written(variant)
    name = f"{quantized.parent.name}--{quantized.name}--{_fingerprint(quantized)}-ct"
    left = Path(cache_dir() / "models" / f".converting-{name}-killed")
    left.mkdir(parents=True)  # a conversion killed midway
    converted = as_compressed(str(quantized))
    assert converted == str(cache_dir() / "models" / name) and as_compressed(str(quantized)) == converted  # once, then cached
    assert not left.exists()
    assert json.loads(Path(converted, "config.json").read_text())["quantization_config"]["quant_method"] == "compressed-tensors"
    model = _from_pretrained(converted, torch.float32, "sdpa")
    decompress_all(model)
    want = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    for name, module in want.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in name:
            assert torch.equal(model.get_submodule(name).weight.float(), module.weight), name

    _, _, offset, k_quant = VARIANTS[variant]
    with LLM(model=str(quantized), dtype="float32", compile=False, max_num_seqs=4, **ON_TEST_DEVICE) as llm:
        assert llm.engine.runner.num_quantized == 14
        layer = llm.engine.runner.model.model.layers[0].mlp.down_proj
        assert layer.carpool_q_offset == offset and (layer.carpool_q_super_mins is not None) == k_quant
        assert (getattr(layer, "carpool_input_order", None) is not None) == ("act-order" in variant)
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)]
        assert_idle(llm.engine)
    assert got == _greedy(want, PROMPTS, 24)


@needs_bf16
@pytest.mark.parametrize("variant", ["awq", "gptq-4-act-order"])
def test_alone_equals_batched_chunked_and_preempted(written, variant):
    assert_alone_equals_batched_chunked_and_preempted(14, model=str(written(variant)[0]))


@needs_f32
def test_lora_adapters_on_a_gptq_base_in_activation_order_give_peft_s_tokens(written, tiny_llama, tmp_path):
    """QLoRA's arrangement on a GPTQ base whose layers gather their inputs (activation order): a
    real peft adapter's matrices dense (float32) beside them; greedy tokens equal peft's on the
    checkpoint's weights, with and without the adapter in one batch."""
    from tests.lora_adapters import make_adapter

    quantized, reference = written("gptq-4-act-order")
    adapter = make_adapter(tiny_llama, tmp_path / "adapter", r=8, strength=0.5)
    assert_lora_gives_peft_tokens(str(reference), adapter, 14, model=str(quantized))


@needs_bf16
def test_the_default_model_in_awq_keeps_transformers_perplexity(smollm2_path, tmp_path, capsys):
    """SmolLM2 written as AWQ (groups of 64), bf16 activations, eager: perplexity on a fixed text
    within 1 % of transformers' (float32) on the same weights."""
    quantized, reference = write_awq(smollm2_path, tmp_path / "smollm2-awq", group_size=64)
    with LLM(model=str(quantized), compile=False, max_num_seqs=1, **ON_TEST_DEVICE) as llm:
        assert llm.engine.runner.num_quantized == 210
        ids = llm.tokenizer.encode(TEXT)
        [out] = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=0, prompt_logprobs=0))
        engine = math.exp(-sum(entry.logprob for entry in out.prompt_logprobs[1:]) / (len(ids) - 1))
        assert_idle(llm.engine)
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        logprobs = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
    expected = math.exp(-float(logprobs.gather(1, torch.tensor(ids[1:])[:, None]).mean()))
    with capsys.disabled():
        print(f"\nSmolLM2 AWQ perplexity: engine (bf16) {engine:.4f}, transformers on its weights (float32) {expected:.4f}")
    assert abs(engine / expected - 1) <= 0.01


def _with_config(folder: Path, target: Path, **changes) -> str:
    import shutil

    copy = shutil.copytree(folder, target)
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"].update(changes)
    (copy / "config.json").write_text(json.dumps(config))
    return str(copy)


@needs_f32
def test_what_is_not_served_is_refused_by_name(written, tmp_path):
    from safetensors.torch import load_file, save_file

    from replica.quant.checkpoint import check_checkpoint

    awq, gptq = str(written("awq")[0]), str(written("gptq-4-sym")[0])
    refused = {  # before Ray (carpool serve) and in the replica
        _with_config(Path(awq), tmp_path / "gemv", version="GEMV"): "4-bit gemv checkpoints are not served",
        _with_config(Path(gptq), tmp_path / "three", bits=3): "3-bit checkpoints in format gptq are not served",
        _with_config(Path(gptq), tmp_path / "marlin", checkpoint_format="marlin"): "in format marlin are not served",
        _with_config(Path(gptq), tmp_path / "dynamic", dynamic={"-:.*down_proj": {}}): "per-module overrides",
        _with_config(Path(awq), tmp_path / "no-zero", zero_point=False): "without zero points",
        _with_config(Path(gptq), tmp_path / "head", lm_head=True): "quantizes lm_head, which this model ties",
    }
    for path, said in refused.items():
        with pytest.raises(ValueError, match=said):
            check_checkpoint(path, None, 1)
    with pytest.raises(ValueError, match="the model is a gptq checkpoint: serve it with quantization gptq \\(or unset\\), not awq"):
        check_checkpoint(gptq, "awq", 1)
    check_checkpoint(awq, None, 2)  # each rank its part (test_quantized_tensor_parallel.py)
    check_checkpoint(awq, "awq", 1)
    with pytest.raises(ValueError, match="quantization awq needs a checkpoint whose config.json has an awq quantization_config"):
        check_checkpoint(str(written("awq")[1]), "awq", 1)
    with pytest.raises(ValueError, match="an awq checkpoint: serve it with quantization awq"):
        check_checkpoint(awq, "int4", 1)
    with pytest.raises(ValueError, match="quantization gptq needs a checkpoint whose config.json has a gptq quantization_config"):
        check_checkpoint(str(written("awq")[1]), "gptq", 1)  # the plain reference

    damaged = _with_config(Path(gptq), tmp_path / "damaged")
    Path(damaged, "model.safetensors").write_bytes(Path(damaged, "model.safetensors").read_bytes()[:5000])
    with pytest.raises(ValueError, match="damaged: its gptq checkpoint does not convert"):
        LLM(model=damaged, dtype="float32", compile=False, max_num_seqs=1, **ON_TEST_DEVICE)
    Path(damaged, "model.safetensors").rename(Path(damaged, "gptq_model-4bit-32g.safetensors"))
    with pytest.raises(ValueError, match="is converted from model.safetensors \\(or its index\\), which it lacks"):
        LLM(model=damaged, dtype="float32", compile=False, max_num_seqs=1, **ON_TEST_DEVICE)
    lopsided = _with_config(Path(gptq), tmp_path / "no-zeros")
    tensors = load_file(f"{lopsided}/model.safetensors")
    del tensors["model.layers.1.self_attn.o_proj.qzeros"]
    save_file(tensors, f"{lopsided}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.1.self_attn.o_proj.qweight comes without model.layers.1.self_attn.o_proj.qzeros"):
        LLM(model=lopsided, dtype="float32", compile=False, max_num_seqs=1, **ON_TEST_DEVICE)
    skewed = _with_config(Path(gptq), tmp_path / "skewed", sym=True)
    tensors = load_file(f"{skewed}/model.safetensors")
    tensors["model.layers.0.mlp.up_proj.qzeros"] += 1  # zero points 9 where sym says 8
    save_file(tensors, f"{skewed}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="layer model.layers.0.mlp.up_proj is symmetric \\(sym\\) but its zero points are not 8"):
        LLM(model=skewed, dtype="float32", compile=False, max_num_seqs=1, **ON_TEST_DEVICE)
