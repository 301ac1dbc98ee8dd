"""Multi-LoRA: one batch mixes requests of several PEFT LoRA adapters and of the base model.

Greedy tokens of each request equal peft's own ``generate`` with that request's adapter (or
transformers' base model), in fp32, on random adapters made with the real ``peft`` library
(``tests/lora_adapters.py``): alone, mixed in one step with 3 other adapters and base requests,
with staggered arrivals, chunked, preempted (both policies), eager and compiled; on the tiny Llama,
on a tiny Qwen3 whose projections are not square (4 query heads of 32, 1 KV head), and on the real
SmolLM2. Adapters differ in rank (2 to 16, below ``max_lora_rank`` too), ``lora_alpha``, rsLoRA and
target modules (attention only, MLP only, all). Also: ``max_loras`` slots shared by more adapters
(requests wait for a slot, never fail), the scaling formula, prefix caching per adapter, and the
adapters the engine refuses (``LoRAAdapterError``, nothing queued, the engine serves on).
Every test ends with every KV block free and nothing running.
"""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from replica import LLM, SamplingParams
from replica.protocol.errors import LoRAAdapterError
from replica.protocol.lora_request import LoRARequest
from tests.engine.conftest import TINY
from tests.engine.test_fidelity import WORKLOAD
from tests.helpers import ON_TEST_DEVICE, assert_idle
from tests.lora_adapters import ALL_LINEARS, edit_adapter_config, explain_mismatch, make_adapter, peft_greedy

pytestmark = pytest.mark.timeout(400)

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")

# The tiny Llama's 4 adapters: ranks 8, 4, 16 (= max_lora_rank) and 2; plain and rsLoRA scaling;
# every linear, attention only, MLP only.
TINY_ADAPTERS = {
    "a0": dict(r=8, alpha=16, target_modules=ALL_LINEARS, seed=10),
    "a1": dict(r=4, alpha=8, use_rslora=True, target_modules=ALL_LINEARS, seed=11),
    "a2": dict(r=16, alpha=32, target_modules=ATTENTION, seed=12),
    "a3": dict(r=2, alpha=5, target_modules=MLP, seed=13),
}
NAMES = list(TINY_ADAPTERS)
# Request i of WORKLOAD runs under ASSIGN[i]: the 4 adapters and the base model (None) in turn.
ASSIGN = [(NAMES + [None])[i % 5] for i in range(len(WORKLOAD))]
LORA = dict(enable_lora=True, max_loras=4, max_lora_rank=16)


class Adapters:
    """A base model folder, its adapters' LoRARequests and peft's greedy tokens for WORKLOAD under
    each (``refs[None]``: the base model's)."""

    def __init__(self, base: str, requests: dict[str, LoRARequest], prompts, limits):
        self.base, self.requests, self.prompts, self.limits = base, requests, prompts, limits
        self.refs = {None: peft_greedy(base, None, prompts, limits)}
        for name, lora in requests.items():
            self.refs[name] = peft_greedy(base, lora.lora_path, prompts, limits)

    def lora(self, name: str | None) -> LoRARequest | None:
        return None if name is None else self.requests[name]


def _make_adapters(base: str, folder, specs: dict[str, dict], prompts, limits) -> Adapters:
    requests = {}
    for i, (name, spec) in enumerate(specs.items()):
        path = make_adapter(base, folder / name, **spec)
        requests[name] = LoRARequest(name, i + 1, path)
    return Adapters(base, requests, prompts, limits)


@pytest.fixture(scope="module")
def tiny(tiny_llama, tmp_path_factory) -> Adapters:
    prompts, limits = [ids for ids, _ in WORKLOAD], [m for _, m in WORKLOAD]
    return _make_adapters(tiny_llama, tmp_path_factory.mktemp("lora-tiny"), TINY_ADAPTERS, prompts, limits)


def add(engine, ids, max_tokens, lora, request_id=None):
    return engine.add_request(
        request_id, prompt_token_ids=list(ids), sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens),
        lora_request=lora,
    )


def run(engine, items, plan=None, on_step=None) -> list:
    """Run ``items`` (prompt ids, max_tokens, LoRARequest or None) to completion: all queued before
    the first step, or (``plan="staggered"``) one every other step; ``on_step(engine)`` after each
    step. Returns the requests."""
    pending, requests, step = list(items), [], 0
    while pending or engine.has_unfinished_requests():
        while pending and (plan != "staggered" or step % 2 == 0):
            requests.append(add(engine, *pending.pop(0)))
            if plan == "staggered":
                break
        engine.step()
        if on_step is not None:
            on_step(engine)
        step += 1
    return requests


def assert_tokens(adapters: Adapters, indices, names, requests) -> None:
    """Request k (prompt ``indices[k]`` under adapter ``names[k]``) has peft's tokens and the
    token-level finish reason; a difference is shown with peft's logprobs of both tokens."""
    for i, name, request in zip(indices, names, requests, strict=True):
        got, expected = list(request.output_token_ids), adapters.refs[name][i]
        if got != expected:
            lora = adapters.lora(name)
            _, [logprobs] = peft_greedy(adapters.base, lora and lora.lora_path, [adapters.prompts[i]],
                                        adapters.limits[i], with_logprobs=True)
            raise AssertionError(
                f"prompt {i} ({len(adapters.prompts[i])} tokens) under {name or 'the base model'}: "
                f"{explain_mismatch(got, expected, logprobs)}\n got      {got}\n expected {expected}")
        assert request.finish_reason.value == ("stop" if expected[-1] == 2 else "length"), (i, name)


def _running_adapters(engine) -> set:
    return {name for name, n in engine.lora_stats()["running"].items() if n and name in NAMES}


# ---- the adapters themselves ---------------------------------------------------------------------

def test_the_random_adapters_change_the_greedy_tokens(tiny):
    """Each adapter changes the tokens of most prompts (so a request run under the wrong adapter,
    or none, fails the fidelity tests), and the adapters differ from each other."""
    n = len(WORKLOAD)
    for name in NAMES:
        assert sum(a != b for a, b in zip(tiny.refs[name], tiny.refs[None])) >= 0.75 * n, name
        for other in NAMES:
            if other < name:
                assert sum(a != b for a, b in zip(tiny.refs[name], tiny.refs[other])) >= 0.75 * n, (name, other)


# ---- fidelity on the tiny Llama ------------------------------------------------------------------

SCENARIOS = {
    # name: (engine kwargs, arrival plan)
    "alone": (dict(max_num_seqs=16), None),
    "mixed": (dict(max_num_seqs=16), None),
    "staggered": (dict(max_num_seqs=8), "staggered"),
    "chunked": (dict(max_num_seqs=8, max_num_batched_tokens=24), None),
    # 12 blocks of 16 tokens = 192 token slots for 16 requests of up to 130 tokens each.
    "preempted-continuous": (dict(max_num_seqs=16, num_blocks=12, max_model_len=192), None),
    "preempted-static": (dict(max_num_seqs=16, num_blocks=12, max_model_len=192, batching_policy="static"), None),
}
_shared: dict = {}  # compile -> the LLM that "alone", "mixed" and "staggered" share


# Compiled: the scenarios that change the step's shapes and rows (a step's tokens of several adapters
# and the base, prefill chunks, recompute after preemption); eager: all of them.
COMPILED = ("alone", "mixed", "chunked", "preempted-continuous")


@pytest.mark.parametrize(("scenario", "compile_"), [
    pytest.param(s, c, id=f"{s}-{'compiled' if c else 'eager'}") for s in SCENARIOS for c in (False, True) if not c or s in COMPILED
])
def test_tiny_llama_tokens_equal_peft(tiny, scenario, compile_):
    kwargs, plan = SCENARIOS[scenario]
    if scenario in ("alone", "mixed", "staggered"):
        key = (compile_, tuple(sorted(kwargs.items())))
        if key not in _shared:
            _shared[key] = LLM(model=tiny.base, dtype="float32", **ON_TEST_DEVICE, **LORA, compile=compile_, **kwargs)
        llm = _shared[key]
    else:
        llm = LLM(model=tiny.base, dtype="float32", **ON_TEST_DEVICE, **LORA, compile=compile_, **kwargs)
    engine = llm.engine
    assert_idle(engine)
    indices = list(range(len(WORKLOAD)))
    items = [(WORKLOAD[i][0], WORKLOAD[i][1], tiny.lora(ASSIGN[i])) for i in indices]
    if scenario == "alone":
        for i in indices:
            [request] = run(engine, [items[i]])
            assert_tokens(tiny, [i], [ASSIGN[i]], [request])
        assert_idle(engine)
        return
    seen = []  # per step: (adapters running, base-model requests running)

    def on_step(engine):
        stats = engine.lora_stats()
        assert len(stats["loaded"]) <= 4, stats
        on_adapters = sum(stats["running"].get(n, 0) for n in NAMES)
        seen.append((_running_adapters(engine), engine.stats().num_running - on_adapters))

    requests = run(engine, items, plan, on_step)
    assert_tokens(tiny, indices, ASSIGN, requests)
    if scenario == "mixed":
        # A step ran requests of the 4 adapters and of the base model side by side.
        assert any(adapters == set(NAMES) and on_base > 0 for adapters, on_base in seen), seen
    if scenario.startswith("preempted"):
        assert engine.scheduler.num_preemptions > 0
    assert_idle(engine)


# ---- a model with non-square projections ---------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_qwen3(smollm2_tokenizer, tmp_path_factory) -> Adapters:
    """A tiny Qwen3 with 4 query heads of 32 and 1 KV head: q_proj 64 -> 128, k/v_proj 64 -> 32,
    o_proj 128 -> 64; and 3 adapters on it."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    folder = tmp_path_factory.mktemp("tiny-qwen3-narrow-kv")
    torch.manual_seed(1234)
    config = Qwen3Config(**{**TINY, "num_attention_heads": 4, "num_key_value_heads": 1}, head_dim=32, use_sliding_window=False)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    smollm2_tokenizer.save_pretrained(folder)
    specs = {
        "q0": dict(r=8, alpha=16, target_modules=ALL_LINEARS, seed=20),
        "q1": dict(r=16, alpha=8, use_rslora=True, target_modules=("q_proj", "v_proj"), seed=21),
        "q2": dict(r=4, alpha=12, target_modules=("o_proj", "down_proj", "k_proj"), seed=22),
    }
    prompts, limits = [ids for ids, _ in WORKLOAD], [m for _, m in WORKLOAD]
    return _make_adapters(str(folder), tmp_path_factory.mktemp("lora-qwen3"), specs, prompts, limits)


@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "compiled"])
def test_tiny_qwen3_mixed_and_chunked_tokens_equal_peft(tiny_qwen3, compile_):
    llm = LLM(model=tiny_qwen3.base, dtype="float32", **ON_TEST_DEVICE, **LORA, compile=compile_,
              max_num_seqs=8, max_num_batched_tokens=24)
    names = [(list(tiny_qwen3.requests) + [None])[i % 4] for i in range(len(WORKLOAD))]
    for name in tiny_qwen3.requests:
        assert sum(a != b for a, b in zip(tiny_qwen3.refs[name], tiny_qwen3.refs[None])) >= 0.75 * len(WORKLOAD), name
    items = [(ids, m, tiny_qwen3.lora(n)) for (ids, m), n in zip(WORKLOAD, names)]
    requests = run(llm.engine, items)
    assert_tokens(tiny_qwen3, range(len(WORKLOAD)), names, requests)
    assert_idle(llm.engine)


# ---- the real model ------------------------------------------------------------------------------

SMOL_CHATS = ["What is the capital of France?", "Write a haiku about the sea.", "Give me three tips for better sleep."]


@pytest.mark.slow
def test_smollm2_mixed_batch_tokens_equal_peft(smollm2_path, smollm2_tokenizer, tmp_path_factory):
    """Two random rank-8 adapters on every linear of SmolLM2 (each weight moved by 5% of its norm:
    the answers change and stay plausible text) and the base model, in one batch. Eager: the
    compiled path is checked on the tiny models above; compiling SmolLM2 with LoRA from an empty
    cache costs minutes of this suite's 15 (docs/lora.md, "Cost")."""
    prompts = [
        smollm2_tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False)
        for c in SMOL_CHATS
    ]
    specs = {"s0": dict(r=8, alpha=16, seed=30, strength=0.05), "s1": dict(r=8, alpha=8, seed=31, strength=0.05)}
    smol = _make_adapters(smollm2_path, tmp_path_factory.mktemp("lora-smol"), specs, prompts, [16] * len(prompts))
    for name in specs:
        assert sum(a != b for a, b in zip(smol.refs[name], smol.refs[None])) >= 2, name
    llm = LLM(model=smollm2_path, dtype="float32", **ON_TEST_DEVICE, **LORA, compile=False, max_num_seqs=9)
    names = [n for n in ("s0", "s1", None) for _ in prompts]
    indices = [i for _ in ("s0", "s1", None) for i in range(len(prompts))]
    requests = run(llm.engine, [(prompts[i], 16, smol.lora(n)) for i, n in zip(indices, names)])
    assert_tokens(smol, indices, names, requests)
    assert_idle(llm.engine)


# ---- slots -------------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_more_adapters_than_slots_wait_for_one(tiny, policy):
    """max_loras=2 and requests of 4 adapters (ranks 16 and 2 share slots: what one leaves behind
    must not leak into the next) and of the base model, all queued at once: every request ends
    with peft's tokens; at most 2 adapters are loaded and run at any step; the others wait."""
    llm = LLM(model=tiny.base, dtype="float32", **ON_TEST_DEVICE, enable_lora=True, max_loras=2, max_lora_rank=16,
              max_num_seqs=16, batching_policy=policy, compile=False)
    engine = llm.engine
    assert engine.lora_stats()["max_loras"] == 2
    loads = [engine.lora_stats()["num_slot_loads"]]
    waited = []

    def on_step(engine):
        stats = engine.lora_stats()
        assert len(stats["loaded"]) <= 2 and set(stats["loaded"]) <= set(NAMES), stats
        running = _running_adapters(engine)
        assert running <= set(stats["loaded"]), stats
        assert stats["num_slot_loads"] >= loads[-1], stats
        loads.append(stats["num_slot_loads"])
        waited.append({n for n, k in stats["waiting"].items() if k and n in NAMES})

    indices = list(range(len(WORKLOAD)))
    requests = run(engine, [(WORKLOAD[i][0], WORKLOAD[i][1], tiny.lora(ASSIGN[i])) for i in indices], None, on_step)
    assert_tokens(tiny, indices, ASSIGN, requests)
    assert len(waited[0]) >= 2, waited[0]  # after the first step, 2 adapters' requests still waited
    assert loads[-1] - loads[0] >= 4, loads
    stats = engine.lora_stats()
    assert not any(stats["running"].values()) and not any(stats["waiting"].values()), stats
    assert_idle(engine)


# ---- scaling -------------------------------------------------------------------------------------

def test_rank_below_max_alpha_and_rslora_scaling(tiny, tmp_path):
    """One set of rank-4 weights under 3 configs (max_lora_rank 16): rsLoRA with alpha 8 (scaling
    8 / sqrt(4) = 4), plain with alpha 8 (8 / 4 = 2) and plain with alpha 24 (6). peft's tokens
    differ between the three; the engine's equal each, side by side in one batch."""
    first = make_adapter(tiny.base, tmp_path / "rs", r=4, alpha=8, use_rslora=True, seed=40)
    plain = str(tmp_path / "plain")
    wide = str(tmp_path / "wide")
    shutil.copytree(first, plain)
    edit_adapter_config(plain, use_rslora=False)
    shutil.copytree(first, wide)
    edit_adapter_config(wide, use_rslora=False, lora_alpha=24)
    indices = [i for i, (_, m) in enumerate(WORKLOAD) if m >= 7][:8]
    prompts, limits = [WORKLOAD[i][0] for i in indices], [WORKLOAD[i][1] for i in indices]
    loras = {"rs": LoRARequest("rs", 1, first), "plain": LoRARequest("plain", 2, plain), "wide": LoRARequest("wide", 3, wide)}
    variants = Adapters(tiny.base, loras, prompts, limits)
    for a in loras:
        for b in loras:
            if a < b:
                assert sum(x != y for x, y in zip(variants.refs[a], variants.refs[b])) >= len(indices) // 2, (a, b)
    llm = LLM(model=tiny.base, dtype="float32", **ON_TEST_DEVICE, **LORA, max_num_seqs=24, compile=False)
    names = [n for n in loras for _ in indices]
    ks = [k for _ in loras for k in range(len(indices))]
    requests = run(llm.engine, [(prompts[k], limits[k], loras[n]) for k, n in zip(ks, names)])
    assert_tokens(variants, ks, names, requests)
    assert_idle(llm.engine)


# ---- prefix caching ------------------------------------------------------------------------------

def test_prefix_cache_is_per_adapter(tiny):
    """The same 40-token prompt (2 full blocks) under A, then B, then A, then the base model twice:
    B and the base model find nothing cached, the second A and the second base run hit both
    blocks; then all three at once with another prompt (no sharing within the step, where a wrong
    share would change the tokens), and again (each hits its own blocks)."""
    llm = LLM(model=tiny.base, dtype="float32", **ON_TEST_DEVICE, **LORA, max_num_seqs=8, block_size=16, compile=False)
    engine = llm.engine
    rng = random.Random(77)
    prompts = [[rng.randrange(3, 49152) for _ in range(40)] for _ in range(2)]
    adapters = Adapters(tiny.base, {n: tiny.requests[n] for n in ("a0", "a1")}, prompts, [8, 8])
    hits = lambda: engine.stats().prefix_cache_hits  # noqa: E731

    def one(k, name, expected_hits):
        before = hits()
        [request] = run(engine, [(prompts[k], 8, adapters.lora(name))])
        assert_tokens(adapters, [k], [name], [request])
        assert hits() - before == expected_hits, (k, name)

    one(0, "a0", 0)
    one(0, "a1", 0)  # B: A's blocks are not B's
    one(0, "a0", 32)  # A again: its own 2 full blocks
    one(0, None, 0)
    one(0, None, 32)
    one(0, "a1", 32)
    for expected in (0, 3 * 32):
        before = hits()
        names = ["a0", "a1", None]
        requests = run(engine, [(prompts[1], 8, adapters.lora(n)) for n in names])
        assert_tokens(adapters, [1, 1, 1], names, requests)
        assert hits() - before == expected
    assert_idle(engine)


# ---- adapters the engine refuses -----------------------------------------------------------------

def _edited_copy(src: str, dst: str, *, rename: tuple[str, str] | None = None, targets: list[str] | None = None,
                 drop: str | None = None) -> str:
    """A copy of an adapter with its weights' names edited: ``rename`` replaces a part of each name,
    ``drop`` leaves out the weights whose names contain it; ``targets``: its config's
    ``target_modules``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(f"{src}/adapter_model.safetensors")
    if rename is not None:
        tensors = {k.replace(*rename): v for k, v in tensors.items()}
    if drop is not None:
        tensors = {k: v for k, v in tensors.items() if drop not in k}
    save_file(tensors, f"{dst}/adapter_model.safetensors")
    if targets is not None:
        edit_adapter_config(dst, target_modules=targets)
    return dst


@pytest.fixture(scope="module")
def refused(tiny, tiny_llama, tmp_path_factory) -> dict[str, LoRARequest]:
    """Adapters the tiny Llama's engine (max_lora_rank 8) must refuse, by reason."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    folder = tmp_path_factory.mktemp("lora-refused")
    small = folder / "small-llama"
    torch.manual_seed(5)
    AutoModelForCausalLM.from_config(LlamaConfig(**{**TINY, "hidden_size": 32, "intermediate_size": 48})).save_pretrained(small)
    AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(small)
    (folder / "empty").mkdir()
    a0 = tiny.requests["a0"].lora_path
    embedding = make_adapter(tiny_llama, folder / "emb", r=4, target_modules=("embed_tokens",), seed=51)
    lm_head = make_adapter(tiny_llama, folder / "head", r=4, target_modules=("lm_head",), seed=52)
    paths = {
        "rank-above-max": make_adapter(tiny_llama, folder / "r16", r=16, seed=50),
        # q_proj's weights and target renamed qkv_proj (a fused projection this model lacks).
        "module-the-base-lacks": _edited_copy(a0, str(folder / "qkv"), rename=(".q_proj.", ".qkv_proj."),
                                              targets=[t.replace("q_proj", "qkv_proj") for t in ALL_LINEARS]),
        # q_proj's weights moved to the decoder layer's input_layernorm (not a linear layer).
        "decoder-layer-norm": _edited_copy(a0, str(folder / "norm"), rename=(".self_attn.q_proj.", ".input_layernorm."),
                                           targets=["input_layernorm", *ALL_LINEARS[1:]]),
        # peft's own adapters on the embedding and on lm_head (a linear outside the decoder
        # layers); peft saves the tied base weight beside them ...
        "embedding": embedding,
        "lm-head": lm_head,
        # ... and the same with only the LoRA matrices.
        "embedding-lora-only": _edited_copy(embedding, str(folder / "emb-only"), drop="base_layer"),
        "lm-head-lora-only": _edited_copy(lm_head, str(folder / "head-only"), drop="base_layer"),
        "other-model-size": make_adapter(str(small), folder / "small", r=4, seed=53),
        "no-adapter-files": str(folder / "empty"),
        "no-such-path": str(folder / "missing"),
    }
    return {reason: LoRARequest(f"bad-{reason}", 100 + i, path) for i, (reason, path) in enumerate(paths.items())}


# reason -> what the error message must name
REFUSALS = {
    "rank-above-max": "max_lora_rank", "module-the-base-lacks": "qkv_proj", "decoder-layer-norm": "input_layernorm",
    "embedding": "embed_tokens", "lm-head": "lm_head", "embedding-lora-only": "embed_tokens", "lm-head-lora-only": "lm_head",
    "other-model-size": r"\(4, 48\)|\(4, 32\)|\(32, 4\)|\(48, 4\)", "no-adapter-files": "adapter_config.json",
    "no-such-path": "missing",
}


@pytest.fixture(scope="module")
def rank8_llm(tiny) -> LLM:
    return LLM(model=tiny.base, dtype="float32", **ON_TEST_DEVICE, enable_lora=True, max_loras=2, max_lora_rank=8,
               max_num_seqs=4, compile=False)


def _assert_serves_on(llm, tiny) -> None:
    """The engine still gives adapter a0's and the base model's tokens."""
    requests = run(llm.engine, [(WORKLOAD[i][0], WORKLOAD[i][1], tiny.lora(ASSIGN[i])) for i in (0, 4)])
    assert_tokens(tiny, [0, 4], [ASSIGN[0], ASSIGN[4]], requests)
    assert_idle(llm.engine)


@pytest.mark.parametrize("reason", list(REFUSALS))
def test_an_unusable_adapter_is_refused_and_nothing_is_queued(rank8_llm, tiny, refused, reason):
    llm, engine, bad = rank8_llm, rank8_llm.engine, refused[reason]
    assert_idle(engine)
    params = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(LoRAAdapterError, match=REFUSALS[reason]):
        engine.add_request("refused", prompt_token_ids=WORKLOAD[0][0], sampling_params=params, lora_request=bad)
    assert "refused" not in engine.scheduler.requests
    assert_idle(engine)
    # One bad adapter in a generate call: none of its prompts is queued (the good one either).
    with pytest.raises(LoRAAdapterError, match=REFUSALS[reason]):
        llm.generate(prompt_token_ids=[WORKLOAD[0][0], WORKLOAD[1][0]], sampling_params=params,
                     lora_request=[tiny.lora("a0"), bad])
    assert_idle(engine)
    stats = engine.lora_stats()
    assert bad.lora_name not in stats["loaded"] and not any(stats["running"].values()) and not any(stats["waiting"].values())
    _assert_serves_on(llm, tiny)


def test_a_lora_request_without_enable_lora_is_refused(llm, tiny):
    """The module's tiny Llama engine without ``enable_lora``."""
    assert_idle(llm.engine)
    with pytest.raises(LoRAAdapterError, match="enable_lora"):
        llm.generate(prompt_token_ids=[WORKLOAD[0][0]], sampling_params=SamplingParams(temperature=0, max_tokens=4),
                     lora_request=tiny.lora("a0"))
    with pytest.raises(LoRAAdapterError, match="enable_lora"):
        llm.engine.add_request("x", prompt_token_ids=WORKLOAD[0][0], sampling_params=SamplingParams(max_tokens=4),
                               lora_request=tiny.lora("a0"))
    assert_idle(llm.engine)
    [out] = llm.generate(prompt_token_ids=[WORKLOAD[4][0]], sampling_params=SamplingParams(temperature=0, max_tokens=WORKLOAD[4][1]))
    assert out.outputs[0].token_ids == tiny.refs[None][4]
    assert_idle(llm.engine)



