"""Structured output in the engine, on the real SmolLM2 (fp32, eager: no compile time).

Constrained outputs are valid (JSON parsed and checked against its schema, regexes, choices, a
Lark grammar) and end with ``stop`` when the constraint is complete; unconstrained requests keep
their exact tokens next to constrained ones; a constrained request has the same tokens alone,
batched, chunked, preempted and under the static policy; length cuts, ``n`` choices, dead ends,
refused constraints and the metrics. Every test ends with all KV blocks free.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from replica import LLM, SamplingParams
from replica.engine.llm_engine import LLMEngine
from replica.engine.metrics import EngineMetrics
from replica.protocol.constraints import DEAD_END, StructuredOutputsParams
from replica.sample.grammar import forbidden_tokens
from tests.helpers import ON_TEST_DEVICE, assert_idle

pytestmark = pytest.mark.timeout(300)

CAT_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "colors": {"type": "array", "items": {"enum": ["black", "white", "orange", "grey"]}, "maxItems": 2},
        "indoor": {"type": "boolean"},
    },
    "required": ["name", "age", "colors", "indoor"],
    "additionalProperties": False,
}
CITY_REGEX = r"[A-Z][a-z]{2,8}"
YES_NO = ["yes", "no"]
ANSWER_LARK = 'start: "The answer is " NUM\nNUM: /[0-9]{1,3}/'
ANSWER_RE = r"The answer is [0-9]{1,3}"


def engine_kwargs(**kw) -> dict:
    return dict(dtype="float32", compile=False, **ON_TEST_DEVICE, **kw)


@pytest.fixture(scope="module")
def llm(smollm2_path) -> LLM:
    return LLM(model=smollm2_path, max_num_seqs=8, **engine_kwargs())


@pytest.fixture(scope="module")
def chat(llm):
    def ids(content: str) -> list[int]:
        return llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True, return_dict=False
        )

    return ids


CAT = "Describe a cat as JSON: its name, age, colors and whether it lives indoors."
CITY = "What is the capital of France? One word."
SKY = "Is the sky blue? Answer yes or no."
MATH = "What is 12 times 12?"
UNCONSTRAINED = ["What is the capital of France?", "Write a haiku about the sea.", "Give me three tips for better sleep."]


def constrained(kind: str, temperature: float = 0.0, seed: int | None = None, max_tokens: int = 48) -> tuple[str, SamplingParams]:
    """A prompt and constrained params of each kind."""
    prompt, so = {
        "json": (CAT, {"json": CAT_SCHEMA}),
        "json_object": ("Reply with a JSON object with one key 'answer': what is 2+2?", {"json_object": True}),
        "regex": (CITY, {"regex": CITY_REGEX}),
        "choice": (SKY, {"choice": YES_NO}),
        "grammar": (MATH, {"grammar": ANSWER_LARK}),
    }[kind]
    return prompt, SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens, structured_outputs=so)


def check_valid(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), CAT_SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(CITY_REGEX, text), text
    elif kind == "choice":
        assert text in YES_NO
    else:
        assert re.fullmatch(ANSWER_RE, text), text


def generate(llm: LLM, chat, items: list[tuple[str, SamplingParams]]):
    outs = llm.generate(prompt_token_ids=[chat(p) for p, _ in items], sampling_params=[sp for _, sp in items])
    assert_idle(llm.engine)
    return [o.outputs[0] for o in outs]


def run_engine(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]):
    """All requests at once, stepped to the end: the requests, their streamed texts, and for
    each the output tokens it had each time it was preempted."""
    requests = [engine.add_request(None, prompt_token_ids=p, sampling_params=sp) for p, sp in zip(prompts, params)]
    by_id = {r.request_id: r for r in requests}
    texts = {r.request_id: "" for r in requests}
    preempted_at: dict[str, list[int]] = {r.request_id: [] for r in requests}

    def note_preempted(record) -> None:
        for request_id in record.preempted:
            preempted_at[request_id].append(by_id[request_id].num_output_tokens)

    remove_observer = engine.add_step_observer(note_preempted)
    try:
        while engine.has_unfinished_requests():
            for delta in engine.step():
                texts[delta.request_id] += delta.new_text
    finally:
        remove_observer()
    assert_idle(engine)
    return requests, [texts[r.request_id] for r in requests], [preempted_at[r.request_id] for r in requests]


# ---- valid outputs -----------------------------------------------------------------------------


def test_json_schema_sampled_outputs_parse_validate_and_stop(llm, chat):
    items = [constrained("json", temperature=1.0, seed=s) for s in range(4)] + [constrained("json")]
    outs = generate(llm, chat, items)
    for out in outs:
        assert out.finish_reason == "stop" and out.stop_reason is None, out
        check_valid("json", out.text)
        assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        assert len(out.token_ids) < 48


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_regex_choice_grammar_and_json_object_outputs_match(llm, chat, temperature):
    kinds = ["regex", "choice", "grammar", "json_object"]
    outs = generate(llm, chat, [constrained(k, temperature=temperature, seed=3) for k in kinds])
    for kind, out in zip(kinds, outs):
        assert out.finish_reason == "stop" and out.stop_reason is None, (kind, out)
        check_valid(kind, out.text)


# ---- fidelity ----------------------------------------------------------------------------------


def test_unconstrained_tokens_unchanged_by_constrained_neighbours(llm, chat):
    """The key requirement: rows without a constraint are not touched by the masks of their
    neighbours. Greedy requests alone take the sampler's plain-greedy path; next to constrained
    ones, the full path; a seeded random request is batch-independent either way."""
    greedy = [(p, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)) for p in UNCONSTRAINED]
    seeded = (MATH, SamplingParams(temperature=0.8, top_p=0.95, seed=5, max_tokens=16, ignore_eos=True))
    alone_greedy = [o.token_ids for o in generate(llm, chat, greedy)]
    [alone_seeded] = [o.token_ids for o in generate(llm, chat, [seeded])]

    neighbours = [constrained("json"), constrained("choice"), constrained("json", temperature=1.0, seed=1),
                  constrained("regex", temperature=1.0, seed=2)]
    mixed_items = [neighbours[0], greedy[0], neighbours[1], greedy[1], seeded, neighbours[2], greedy[2], neighbours[3]]
    mixed = generate(llm, chat, mixed_items)
    assert [mixed[i].token_ids for i in (1, 3, 6)] == alone_greedy
    assert mixed[4].token_ids == alone_seeded
    assert all(len(t) == 16 for t in alone_greedy + [alone_seeded])
    for i, kind in ((0, "json"), (2, "choice"), (5, "json"), (7, "regex")):
        assert mixed[i].finish_reason == "stop"
        check_valid(kind, mixed[i].text)


SCHEDULES = {
    "batched": dict(max_num_seqs=8),
    "chunked": dict(max_num_seqs=8, max_num_batched_tokens=16),
    # 9 blocks of 16 tokens for prompts of ~40-50 tokens plus up to 40 outputs: preemption by recompute.
    "preempted": dict(max_num_seqs=8, num_blocks=9, max_model_len=144),
    "static": dict(max_num_seqs=8, batching_policy="static"),
}
_alone: dict[str, list[int]] = {}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_constrained_greedy_tokens_same_in_every_schedule(llm, chat, smollm2_path, schedule):
    kinds = ["json", "grammar", "regex"]
    if not _alone:
        for kind in kinds:
            [out] = generate(llm, chat, [constrained(kind)])
            assert out.finish_reason == "stop"
            _alone[kind] = out.token_ids
    engine = llm.engine if schedule == "batched" else LLMEngine(model=smollm2_path, **engine_kwargs(**SCHEDULES[schedule]))
    # Neighbours first: unconstrained requests long enough to outlive the constrained ones, and
    # a sampled constrained request. The requests under test come last, so that they are the
    # ones preempted (the scheduler preempts the latest running request).
    items = [(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)) for p in UNCONSTRAINED[:2]]
    items.append(constrained("json", temperature=1.0, seed=9))
    items += [constrained(k) for k in kinds]
    requests, texts, preempted_at = run_engine(engine, [chat(p) for p, _ in items], [sp for _, sp in items])
    for kind, request, text in zip(kinds, requests[3:], texts[3:]):
        assert request.output_token_ids == _alone[kind], kind
        assert request.finish_reason.value == "stop"
        check_valid(kind, text)
    check_valid("json", texts[2])
    if schedule == "preempted":
        # A constrained request lost its KV mid-output; its matcher carried on where it was.
        assert any(n > 0 for counts in preempted_at[3:] for n in counts), preempted_at
    else:
        assert not any(preempted_at)
    if schedule == "chunked":
        assert all(len(chat(p)) > 16 for p, _ in items)  # every prompt took several chunks


# ---- lengths, n choices, dead ends -------------------------------------------------------------


def test_max_tokens_cuts_json_short(llm, chat):
    prompt, params = constrained("json", max_tokens=6)
    [out] = generate(llm, chat, [(prompt, params)])
    assert out.finish_reason == "length" and len(out.token_ids) == 6
    assert out.text.startswith('{"name": "')
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def test_n_choices_are_each_constrained(llm, chat):
    params = SamplingParams(n=3, temperature=1.0, seed=21, max_tokens=48, structured_outputs={"json": CAT_SCHEMA})
    [result] = llm.generate(prompt_token_ids=[chat(CAT)], sampling_params=params)
    assert [c.index for c in result.outputs] == [0, 1, 2]
    for choice in result.outputs:
        assert choice.finish_reason == "stop"
        check_valid("json", choice.text)
    assert_idle(llm.engine)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_dead_end_aborts_only_that_request(llm, chat, temperature):
    """``min_tokens`` bans the stop tokens, which are every token the constraint allows first:
    no token can continue, the request ends with ``abort`` and ``DEAD_END``; its neighbour does not notice."""
    so = StructuredOutputsParams(choice=["yes"])
    g = llm.engine.grammar_compiler.compile(so)
    bitmask = torch.zeros(1, (llm.engine.vocab_size + 31) // 32, dtype=torch.int32)
    g.fill_bitmask(bitmask, 0)
    allowed = (~forbidden_tokens(bitmask, llm.engine.vocab_size))[0].nonzero().flatten().tolist()
    assert allowed and llm.tokenizer.encode("yes")[0] in allowed
    neighbour = (MATH, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    [alone] = generate(llm, chat, [neighbour])
    dead = SamplingParams(temperature=temperature, seed=4, max_tokens=8, min_tokens=1, stop_token_ids=allowed, structured_outputs=so)
    out, other = generate(llm, chat, [(SKY, dead), neighbour])
    assert out.finish_reason == "abort" and out.stop_reason == DEAD_END
    assert len(out.token_ids) == 1 and out.token_ids[0] not in allowed and out.text == ""
    assert other.token_ids == alone.token_ids and other.finish_reason == "length"


def test_constraint_completes_before_min_tokens(llm, chat):
    """A complete constraint ends the request at once (``stop``), even before ``min_tokens``."""
    prompt, params = constrained("choice")
    params = SamplingParams(temperature=0, max_tokens=10, min_tokens=5, structured_outputs=params.structured_outputs)
    [out] = generate(llm, chat, [(prompt, params)])
    assert out.finish_reason == "stop" and out.text in YES_NO and len(out.token_ids) < 5


# ---- refused constraints, metrics --------------------------------------------------------------


BAD = [
    ({"regex": "(abc"}, r"structured_outputs\.regex"),
    ({"json": {"type": "foo"}}, r"structured_outputs\.json"),
    ({"json": '{"type": "object"'}, r"structured_outputs\.json"),
    ({"grammar": "start: foo"}, r"structured_outputs\.grammar"),
]


@pytest.mark.parametrize("bad, field", BAD, ids=["regex", "json-type", "json-text", "lark"])
def test_bad_constraint_refused_and_nothing_queued(llm, chat, bad, field):
    engine = llm.engine
    params = SamplingParams(max_tokens=4, structured_outputs=bad)  # the shape is fine: refused at compile
    with pytest.raises(ValueError, match=field):
        engine.make_request(None, prompt_token_ids=chat(SKY), sampling_params=params)
    with pytest.raises(ValueError, match=field):
        engine.add_request(None, prompt_token_ids=chat(SKY), sampling_params=params)
    assert not engine.has_unfinished_requests()
    # A batch with one bad member queues none of them.
    good = SamplingParams(max_tokens=4, structured_outputs={"choice": YES_NO})
    with pytest.raises(ValueError, match=field):
        llm.generate(prompt_token_ids=[chat(SKY), chat(SKY)], sampling_params=[good, params])
    assert not engine.has_unfinished_requests()
    assert_idle(engine)


def test_metrics_count_kinds_compiles_and_cache_hits(smollm2_path, chat):
    metrics = EngineMetrics("smollm2", "r0")
    engine = LLMEngine(model=smollm2_path, metrics=metrics, **engine_kwargs(max_num_seqs=4))
    labels = {"model_name": "smollm2", "replica": "r0"}

    def value(name: str, **extra) -> float:
        v = metrics.registry.get_sample_value(name, {**labels, **extra})
        assert v is not None, f"no sample {name} {extra}"
        return v

    def snapshot():
        return (
            {k: value("carpool:structured_output_requests_total", kind=k) for k in ("json", "regex", "choice", "json_object", "grammar")},
            value("carpool:grammar_compile_seconds_count"),
            value("carpool:grammar_cache_hits_total"),
        )

    assert snapshot() == ({"json": 0, "regex": 0, "choice": 0, "json_object": 0, "grammar": 0}, 0, 0)
    prompt = chat(CAT)
    as_text = json.dumps(dict(reversed(list(CAT_SCHEMA.items()))))  # the same schema, keys reordered
    params = [
        SamplingParams(temperature=0, max_tokens=48, structured_outputs={"json": CAT_SCHEMA}),
        SamplingParams(temperature=0, max_tokens=48, structured_outputs={"json": as_text}),
        SamplingParams(temperature=0, max_tokens=8, structured_outputs={"regex": CITY_REGEX}),
        SamplingParams(temperature=0, max_tokens=8),
    ]
    engine.add_request(None, prompt_token_ids=prompt, sampling_params=params[0])
    kinds, compiles, hits = snapshot()
    assert (kinds["json"], compiles, hits) == (1, 1, 0)
    assert value("carpool:grammar_compile_seconds_sum") > 0
    for p in params[1:]:
        engine.add_request(None, prompt_token_ids=prompt, sampling_params=p)
    kinds, compiles, hits = snapshot()
    assert kinds == {"json": 2, "regex": 1, "choice": 0, "json_object": 0, "grammar": 0}
    assert (compiles, hits) == (2, 1)
    # A refused constraint counts as a rejection, not as a constrained request.
    with pytest.raises(ValueError, match="structured_outputs"):
        engine.add_request(None, prompt_token_ids=prompt, sampling_params=SamplingParams(structured_outputs={"regex": "(abc"}))
    assert snapshot()[0] == kinds
    assert value("carpool:requests_rejected_total") == 1
    while engine.has_unfinished_requests():
        engine.step()
    assert value("carpool:request_success_total", finished_reason="stop") >= 3
    assert_idle(engine)


def test_a_bounded_json_number_accepts_in_range_values_only(smollm2_tokenizer):
    """The e2e schemas keep to integers (a number's digits are unbounded at temperature 1); the
    grammar's handling of a bounded ``number`` is checked here, token by token."""
    from replica.protocol.constraints import StructuredOutputsParams
    from replica.sample.grammar import GrammarCompiler

    compiler = GrammarCompiler(smollm2_tokenizer, 49152)
    schema = {"type": "object", "properties": {"hours": {"type": "number", "minimum": 0, "maximum": 24}},
              "required": ["hours"], "additionalProperties": False}

    def accepts(text: str) -> bool:
        grammar = compiler.compile(StructuredOutputsParams(json=schema))
        ok = all(grammar.accept(t) for t in smollm2_tokenizer.encode(text))
        return ok and grammar.is_finished

    assert accepts('{"hours": 5.5}') and accepts('{"hours": 24}') and accepts('{"hours": 0}')
    for bad in ('{"hours": 25}', '{"hours": -1}', '{"hours": "5"}'):
        assert not accepts(bad), bad
