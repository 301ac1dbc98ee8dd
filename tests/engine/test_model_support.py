"""Models whose layers need what Carpool's cache and attention do not implement are refused at
start with a clear error, never served with wrong tokens (replica/worker/model_support.py, and the
attention function's own check of what each layer passes it)."""

from __future__ import annotations

import pytest
import torch

from replica import LLM
from replica.attention.op import IGNORED_ARGUMENTS, paged_attention_forward
from replica.worker.model_support import check_supported
from tests.engine.conftest import _config
from tests.helpers import ON_TEST_DEVICE, TEST_DEVICE, assert_idle

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def _refused_configs():
    import transformers as t

    return {
        "gpt_oss sinks": (_config("gpt_oss"), "gpt_oss: its attention needs attention sinks"),
        "falcon alibi": (t.FalconConfig(**SMALL, alibi=True), "falcon: its attention needs ALiBi position biases"),
        "llama4 chunked": (
            t.Llama4TextConfig(**SMALL, intermediate_size_mlp=64, head_dim=16, num_local_experts=2),
            "llama4_text: its attention needs layers of type chunked_attention and attention temperature tuning",
        ),
        "llama4 unchunked": (
            t.Llama4TextConfig(**SMALL, intermediate_size_mlp=64, head_dim=16, num_local_experts=2, attention_chunk_size=None),
            "llama4_text: its attention needs attention temperature tuning",
        ),
        "deepseek_v32 sparse": (t.DeepseekV32Config(**SMALL), "layers of type indexed_attention"),
        "falcon_h1 hybrid": (t.FalconH1Config(**SMALL), r"layers of type hybrid and a state carried between steps \(FalconH1Mixer\)"),
        "qwen3_next linear attention": (t.Qwen3NextConfig(**SMALL), "layers of type linear_attention"),
        "mamba": (t.MambaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2), r"a state carried between steps \(MambaMixer\)"),
        "bert encoder": (t.BertConfig(**SMALL), r"bert: its attention needs bidirectional attention \(an encoder"),
        "bloom alibi": (t.BloomConfig(vocab_size=256, hidden_size=64, n_layer=2, n_head=4), ATTENTION_OF_ITS_OWN),
        "mpt alibi": (t.MptConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4), ATTENTION_OF_ITS_OWN),
    }


ATTENTION_OF_ITS_OWN = "none of its layers attends through transformers' attention interface"


@pytest.mark.parametrize("case", list(_refused_configs()))
def test_a_model_that_needs_more_than_causal_attention_over_the_paged_cache_is_refused(case):
    """Chunked, sparse, linear or hybrid SSM layers, ALiBi, Llama 4's temperature tuning and
    attention sinks each make Carpool's tokens wrong (or fail every step); each is named."""
    from transformers import AutoModelForCausalLM

    config, message = _refused_configs()[case]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=message):
        check_supported(model)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gemma3", "falcon", "phimoe"])
def test_models_carpool_serves_are_not_refused(family):
    """The families the fidelity tests serve, plus Falcon without ALiBi and PhiMoE (whose router is
    a linear layer with a forward of its own), pass the check."""
    import transformers as t
    from transformers import AutoModelForCausalLM

    extra = {"falcon": lambda: t.FalconConfig(**SMALL), "phimoe": lambda: t.PhimoeConfig(**SMALL, num_local_experts=4)}
    config = extra[family]() if family in extra else _config(family)
    with torch.device("meta"):
        check_supported(AutoModelForCausalLM.from_config(config))


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_a_model_whose_attention_needs_soft_capping_is_refused_at_start(tiny_model_factory, compile):
    """Gemma 2 soft-caps its attention logits, which Carpool's attention does not implement. The
    engine refuses it at start, compiled or not."""
    with pytest.raises(ValueError, match=r"gemma2: its attention needs logit soft-capping \(50.0\)"):
        LLM(model=tiny_model_factory("gemma2"), dtype="float32", **ON_TEST_DEVICE, num_blocks=32, compile=compile)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_an_attention_argument_the_check_let_through_fails_at_start(tiny_model_factory, monkeypatch, compile):
    """The attention function refuses what it does not compute, and every engine runs one forward
    at start (``probe_attention``), so a model the config check let through still fails at start
    rather than in every step. Here GPT-OSS, with the check switched off, passes its sinks."""
    import replica.worker.model_runner as model_runner

    monkeypatch.setattr(model_runner, "check_supported", lambda model: None)
    with pytest.raises(NotImplementedError, match="carpool_paged does not support s_aux"):
        LLM(model=tiny_model_factory("gpt_oss"), dtype="float32", **ON_TEST_DEVICE, num_blocks=32, compile=compile)


@pytest.mark.parametrize(
    "family, message",
    [
        ("diffllama", "diffllama: its attention layers call attention 2 times in a step"),
        ("deepseek_v3", r"deepseek_v3: its attention layers give queries of head size 24, keys of \(4, 24\) and values of \(4, 16\)"),
    ],
)
def test_a_model_whose_layers_call_attention_in_a_way_the_cache_cannot_hold_is_refused_at_start(tiny_model_factory, family, message):
    """DiffLlama attends twice per layer with two halves of its values (the second would overwrite
    the first's cache); DeepSeek V3's latent attention gives values narrower than keys, while the
    cache holds one head size (sized from ``head_dim``)."""
    with pytest.raises(ValueError, match=message):
        LLM(model=tiny_model_factory(family), dtype="float32", **ON_TEST_DEVICE, num_blocks=32, compile=False)


def test_a_model_that_cannot_take_an_attention_implementation_is_refused_at_load(tmp_path):
    """GPT-Neo looks its attention class up by the implementation's name and raised a bare
    ``KeyError: 'carpool_paged'`` from transformers; the load now says what it means."""
    from transformers import AutoModelForCausalLM, GPTNeoConfig

    from replica.attention.op import register_paged_attention
    from replica.worker.model_loader import load_model

    config = GPTNeoConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]])
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="gpt_neo: its attention does not go through transformers' attention interface"):
        load_model(str(tmp_path), dtype=torch.float32, device="cpu", attn_implementation=register_paged_attention())


def test_a_layer_that_computes_attention_itself_is_refused(tiny_llama):
    """A layer that does not call the attention interface (here one told to use SDPA) would never
    write its K/V into the cache: the probe finds it."""
    import copy

    from replica.worker.model_support import probe_attention

    llm = LLM(model=tiny_llama, dtype="float32", **ON_TEST_DEVICE, num_blocks=32, max_model_len=128, compile=False)
    runner = llm.engine.runner
    assert probe_attention(runner)
    layer = next(m for m in runner.model.modules() if hasattr(m, "carpool_key_cache"))
    layer.config = copy.copy(layer.config)
    layer.config._attn_implementation = "sdpa"
    with pytest.raises(ValueError, match="llama: its attention layers compute attention themselves"):
        probe_attention(runner)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_a_model_whose_layers_drop_attention_arguments_attends_through_the_backend(tiny_model_factory, compile, caplog):
    """Falcon's attention layers do not pass transformers' attention arguments on, so the decode
    step the compiled model traces (``carpool_decode``) never reaches them; its steps then all go
    through the backend, and its greedy tokens equal transformers' (a compiled engine used to fail
    its warm-up)."""
    from tests.engine.test_fidelity import WORKLOAD, reference_tokens, run_engine

    path = tiny_model_factory("falcon")
    llm = LLM(model=path, dtype="float32", **ON_TEST_DEVICE, max_num_seqs=8, max_num_batched_tokens=32, compile=compile)
    assert llm.engine.runner.backend.inline_decode is False
    assert "do not pass on transformers' attention arguments" in caplog.text
    got, _ = run_engine(llm, WORKLOAD, None)
    assert got == reference_tokens(path, WORKLOAD)
    assert_idle(llm.engine)


@pytest.mark.parametrize("family", ["phi", "stablelm"])
def test_a_partial_rotary_model_compiled_gives_transformers_tokens(tiny_model_factory, family):
    """Phi and StableLM rotate part of each head and concatenate it with the rest, so the query
    reaches the attention op non-contiguous. The op returns a contiguous output; its fake returned
    the query's strides, and inductor read the compiled output through them, so the greedy tokens
    were others from the first. On CPU Phi attends through the traced decode step (CUDA has
    none), StableLM through the backend; both must give transformers' tokens compiled."""
    from tests.engine.test_fidelity import WORKLOAD, reference_tokens, run_engine

    path = tiny_model_factory(family)
    llm = LLM(model=path, dtype="float32", **ON_TEST_DEVICE, max_num_seqs=8, max_num_batched_tokens=32, compile=True)
    assert llm.engine.runner.backend.inline_decode is (family == "phi" and TEST_DEVICE == "cpu")
    got, _ = run_engine(llm, WORKLOAD, None)
    assert got == reference_tokens(path, WORKLOAD)
    assert_idle(llm.engine)


def test_a_longrope_model_is_served_below_its_short_length(tiny_model_factory, caplog):
    """Phi-3 128k's longrope rotary embedding switches every position of a forward to its long
    factors once one position passes ``original_max_position_embeddings``: a long prompt batched
    with short ones changed their tokens, and a long prompt's early chunks were encoded with the
    short factors. ``max_model_len`` defaults to that length, a larger one is refused, and below
    it batched and chunked requests give transformers' greedy tokens."""
    from tests.engine.conftest import LONGROPE_SHORT_LEN
    from tests.engine.test_fidelity import reference_tokens, run_engine

    path = tiny_model_factory("phi3_longrope")
    with pytest.raises(ValueError, match="longrope original_max_position_embeddings of 64 tokens"):
        LLM(model=path, dtype="float32", **ON_TEST_DEVICE, max_model_len=LONGROPE_SHORT_LEN + 1, compile=False)
    llm = LLM(model=path, dtype="float32", **ON_TEST_DEVICE, max_num_seqs=4, max_num_batched_tokens=16, compile=False)
    assert llm.engine.max_model_len == LONGROPE_SHORT_LEN
    assert "the model's longrope short length" in caplog.text
    g = torch.Generator().manual_seed(5)
    workload = [([int(t) for t in torch.randint(3, 49152, (n,), generator=g)], 64 - n) for n in (5, 30, 52)]
    got, _ = run_engine(llm, workload, None)
    assert got == reference_tokens(path, workload)
    assert_idle(llm.engine)


class _Layer(torch.nn.Module):
    carpool_key_cache = carpool_value_cache = torch.empty(0)


@pytest.mark.parametrize(
    "mask, kwargs, message",
    [
        (torch.zeros(1, 1, 2, 2), {}, "an attention mask or bias"),
        (None, {"is_causal": False}, "causal attention only"),
        (None, {"softcap": 50.0}, "does not support softcap"),
        (None, {"s_aux": torch.zeros(4)}, "does not support s_aux"),
        (None, {"sinks": torch.zeros(1, 4, 2, 1)}, "does not support sinks"),
        (None, {"position_bias": torch.zeros(1, 4, 2, 2)}, "does not support position_bias"),
        (None, {"indices": torch.zeros(1, 2, 2, dtype=torch.long), "new_kwarg": 1, "off": False}, "does not support indices, new_kwarg$"),
    ],
    ids=["mask", "not-causal", "softcap", "s_aux", "sinks", "position_bias", "indices"],
)
def test_the_attention_function_refuses_what_it_does_not_compute(mask, kwargs, message):
    """Anything a layer passes that would change plain causal attention is refused, including
    arguments transformers may add later; the arguments it ignores are harmless in inference."""
    empty = torch.empty(1, 4, 2, 16)
    with pytest.raises(NotImplementedError, match=message):
        paged_attention_forward(_Layer(), empty, empty, empty, mask, **kwargs)
    assert {"position_ids", "use_cache", "carpool_decode", "sliding_window"} <= IGNORED_ARGUMENTS
    assert not {"softcap", "s_aux", "sinks", "position_bias", "indices", "attention_mask"} & IGNORED_ARGUMENTS
