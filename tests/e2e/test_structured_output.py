"""Structured output and tool calling, end to end (real Ray Serve with 2 replicas, real SmolLM2 in
the served default dtype, the real ``openai`` client):

* 100 concurrent ``json_schema`` chat requests over four schemas (nested objects, arrays, enums,
  required fields) at temperature 1, every other one streamed: every reply parses and validates
  (``jsonschema``); ``client.beta.chat.completions.parse`` with a pydantic model;
* ``json_object``, vLLM's ``structured_outputs`` / ``guided_*`` extras on completions;
* ``tool_choice: "required"`` and a named function: every reply carries a tool call whose
  arguments validate against the function's parameters, not streamed and streamed; a round trip
  with the tool's result sent back;
* bad constraints get a 400 naming the field, and the next request succeeds;
* the constraint metrics reach ``/metrics``.

That constrained neighbours leave an unconstrained request's tokens unchanged is checked on the
engine, in float32 (``tests/engine/test_structured_output.py``).

After every test both replicas must be idle with every KV block free (conftest).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest

from cluster.config import ServeConfig
from replica.config.engine_config import EngineConfig

ENGINE = EngineConfig(dtype="auto", max_num_seqs=32, max_model_len=1024, num_blocks=320, compile=False)
# Streamed tokens travel as the replica call's own Ray stream here (batched_deltas off), so that
# path stays tested; the other modules use the default batched-delta connections.
CONFIG = ServeConfig(app_name="e2e-structured", engine=ENGINE, batched_deltas=False)
CONCURRENT = 100
MAX_TOKENS = 256  # every schema below bounds its JSON well under this

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "address"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 99999},
            "status": {"enum": ["pending", "shipped", "delivered"]},
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {"sku": {"type": "string", "maxLength": 8}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["id", "status", "items"],
        "additionalProperties": False,
    },
    "review": {
        "type": "object",
        "properties": {
            "rating": {"enum": [1, 2, 3, 4, 5]},
            "tags": {"type": "array", "items": {"enum": ["fast", "cheap", "good", "bad"]}, "maxItems": 3},
            "summary": {
                "type": "object",
                "properties": {"title": {"type": "string", "maxLength": 30}, "positive": {"type": "boolean"}},
                "required": ["title", "positive"],
                "additionalProperties": False,
            },
        },
        "required": ["rating", "tags", "summary"],
        "additionalProperties": False,
    },
    "event": {
        "type": "object",
        "properties": {
            "kind": {"type": "string", "enum": ["meeting", "call", "trip"]},
            "attendees": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 3},
            # An integer: a JSON number's digits have no bound (a fraction may run on until
            # max_tokens, as one did at temperature 1), so a "number" would break MAX_TOKENS.
            "hours": {"type": "integer", "minimum": 0, "maximum": 24},
        },
        "required": ["kind", "attendees"],
        "additionalProperties": False,
    },
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "maxLength": 40}, "top_k": {"type": "integer", "minimum": 1, "maximum": 10}},
            "required": ["query"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, SEARCH]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def served(deploy):
    with deploy(CONFIG, replicas=2) as served:
        yield served


def messages(i: int, kind: str) -> list[dict]:
    return [{"role": "user", "content": f"Write one {kind} record as JSON (example {i})."}]


def json_body(served, i: int) -> tuple[str, dict]:
    kind = list(SCHEMAS)[i % len(SCHEMAS)]
    body = {
        "model": served.model,
        "messages": messages(i, kind),
        "temperature": 1.0,
        "max_tokens": MAX_TOKENS,
        "response_format": {"type": "json_schema", "json_schema": {"name": kind, "schema": SCHEMAS[kind], "strict": True}},
    }
    return kind, body


def collect_stream(served, body: dict) -> tuple[str, list[dict], str | None]:
    """(content, tool calls assembled from their deltas, finish_reason) of a streamed chat."""
    content, calls, finish = [], {}, None
    with httpx.stream("POST", served.base_url + "/chat/completions", json={**body, "stream": True}, timeout=180) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                delta = choice["delta"]
                content.append(delta.get("content") or "")
                for call in delta.get("tool_calls") or []:
                    slot = calls.setdefault(call["index"], {"name": "", "arguments": "", "id": None})
                    slot["id"] = call.get("id") or slot["id"]
                    slot["name"] += (call.get("function") or {}).get("name") or ""
                    slot["arguments"] += (call.get("function") or {}).get("arguments") or ""
                finish = choice.get("finish_reason") or finish
    return "".join(content), [calls[k] for k in sorted(calls)], finish


def test_100_concurrent_json_schema_replies_all_validate_streamed_and_not(served):
    """100 requests at once, every other one streamed."""

    def one(i: int) -> tuple[str, str, str | None]:
        kind, body = json_body(served, i)
        if i % 2:
            text, _, finish = collect_stream(served, body)
            return kind, text, finish
        r = httpx.post(served.base_url + "/chat/completions", json=body, timeout=180)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return kind, choice["message"]["content"], choice["finish_reason"]

    with ThreadPoolExecutor(CONCURRENT) as pool:
        replies = list(pool.map(one, range(CONCURRENT)))
    failures = []
    for i, (kind, text, finish) in enumerate(replies):
        try:
            jsonschema.validate(json.loads(text), SCHEMAS[kind])
        except (ValueError, jsonschema.ValidationError) as exc:
            failures.append(("streamed" if i % 2 else "whole", kind, text, finish, str(exc)[:200]))
    assert not failures, f"{len(failures)} of {CONCURRENT} replies invalid: {failures[:3]}"
    assert all(finish == "stop" for _, _, finish in replies), {f for _, _, f in replies}
    assert len({text for _, text, _ in replies}) > CONCURRENT // 2, "temperature 1 should vary the replies"


def test_openai_parse_with_a_pydantic_model(served):
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=20)
        country: str = Field(max_length=20)
        population: int = Field(ge=0, le=10**8)

    completion = served.client.beta.chat.completions.parse(
        model=served.model,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, City), completion
    assert completion.choices[0].finish_reason == "stop"


def test_completions_json_object_regex_choice(served):
    def complete(**extra) -> dict:
        body = {"model": served.model, "prompt": "The answer, as JSON:", "max_tokens": 64, "temperature": 0, **extra}
        r = httpx.post(served.base_url + "/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    # A prompt that leads SmolLM2 to a short object in float32 and in bf16 on every CPU kind tried:
    # after "The answer, as JSON:" its greedy bf16 reply on an AVX512 Xeon without BF16 was one
    # number 200 tokens long (the grammar lets a JSON object run on; it cannot make one end).
    obj = complete(
        prompt='Describe a cat as a JSON object with keys "name" and "age":',
        response_format={"type": "json_object"},
        max_tokens=200,
    )
    assert obj["finish_reason"] == "stop" and isinstance(json.loads(obj["text"]), dict), obj
    date = complete(structured_outputs={"regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"})
    import re

    assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]", date["text"]) and date["finish_reason"] == "stop", date
    pick = complete(guided_choice=["red", "green", "blue"])
    assert pick["text"] in ("red", "green", "blue") and pick["finish_reason"] == "stop", pick
    plain = complete(response_format={"type": "text"}, max_tokens=8)
    assert plain["finish_reason"] == "length"


def tool_body(served, i: int, tool_choice) -> dict:
    question = ["What is the weather in Paris?", "Search for the best pizza in Rome.", "Is it raining in Oslo?"][i % 3]
    return {
        "model": served.model,
        "messages": [{"role": "user", "content": question}],
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "temperature": 1.0,
        "max_tokens": 160,
    }


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_calls_always_carry_valid_arguments(served, choice, stream):
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "search"}}
    count = 10

    def one(i: int) -> tuple[list[dict], str | None, str | None]:
        body = tool_body(served, i, tool_choice)
        if choice == "required" and (stream or i % 3):
            # One call at most, except in every third whole reply, which may hold several (the model
            # then tends to add calls until max_tokens: long replies).
            body["parallel_tool_calls"] = False
        if stream:
            content, calls, finish = collect_stream(served, body)
            return [{"name": c["name"], "arguments": c["arguments"], "id": c["id"]} for c in calls], finish, content or None
        r = httpx.post(served.base_url + "/chat/completions", json=body, timeout=180)
        assert r.status_code == 200, r.text
        choice_ = r.json()["choices"][0]
        message = choice_["message"]
        calls = [{**c["function"], "id": c["id"]} for c in message.get("tool_calls") or []]
        return calls, choice_["finish_reason"], message["content"]

    with ThreadPoolExecutor(count) as pool:
        replies = list(pool.map(one, range(count)))
    for calls, finish, content in replies:
        assert calls, (calls, finish, content)
        assert not content, content
        for call in calls:
            assert call["id"] and call["id"].startswith("call_")
            if choice == "named":
                assert call["name"] == "search"
            jsonschema.validate(json.loads(call["arguments"]), PARAMS[call["name"]])
        if choice == "named":
            assert finish == "stop", finish
        else:  # the model may go on adding calls (parallel_tool_calls) until max_tokens cuts the array
            assert finish in ("tool_calls", "length"), finish
    if choice == "required":
        assert sum(finish == "tool_calls" for _, finish, _ in replies) >= count // 2, [f for _, f, _ in replies]


def test_a_tool_round_trip(served):
    client = served.client
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(
        model=served.model, messages=question, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0, max_tokens=MAX_TOKENS,
    )
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), PARAMS["get_weather"])
    history = question + [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})},
    ]
    second = client.chat.completions.create(
        model=served.model, messages=history, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=32,
    )
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls
    auto = client.chat.completions.create(model=served.model, messages=history, tools=TOOLS, temperature=0, max_tokens=32)
    message = auto.choices[0].message
    assert message.content or message.tool_calls  # auto: text or calls, both parsed, never the raw tags
    assert "<tool_call>" not in (message.content or "") or not message.tool_calls


BAD = [
    ("/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ("/chat/completions", {"response_format": {"type": "yaml"}}, "response_format.type"),
    ("/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ("/chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "no_such_tool"}}}, "tool_choice"),
    ("/chat/completions", {"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ("/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/chat/completions", {"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ("/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}]},
     "tools.0.function.parameters"),
    ("/chat/completions", {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ("/completions", {"structured_outputs": {"regex": "([a-z"}}, "structured_outputs.regex"),
    ("/completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ("/completions", {"guided_json": "{not json"}, "guided_json"),
    ("/completions", {"guided_json": '{"enum": [NaN]}'}, "guided_json"),
    ("/completions", {"guided_json": '{"enum": ' + "[" * 3000 + "]" * 3000 + "}"}, "guided_json"),
    ("/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools.0.function.parameters"),
    ("/completions", {"guided_choice": []}, "guided_choice"),
    ("/completions", {"guided_grammar": "start: nowhere"}, "guided_grammar"),
    ("/completions", {"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    # compiles without the vocabulary (the ingress's check), refused by the replica: no text matches
    ("/completions", {"guided_regex": "[^\\s\\S]"}, "guided_regex"),
    ("/chat/completions", {"structured_outputs": {"regex": "[^\\s\\S]"}}, "structured_outputs.regex"),
]


@pytest.mark.parametrize("path,extra,param", BAD, ids=[b[2] + f"-{i}" for i, b in enumerate(BAD)])
def test_bad_constraints_get_a_400_naming_the_field(served, path, extra, param):
    base = {"messages": [{"role": "user", "content": "Hi"}]} if path == "/chat/completions" else {"prompt": "Hi"}
    r = httpx.post(served.base_url + path, json={"model": served.model, **base, "max_tokens": 4, **extra}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    ok = httpx.post(served.base_url + path, json={"model": served.model, **base, "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200, ok.text


def test_constraint_metrics_reach_the_metrics_endpoint(served):
    body = json_body(served, 0)[1]
    assert httpx.post(served.base_url + "/chat/completions", json=body, timeout=120).status_code == 200
    text = httpx.get(served.root_url + "/metrics", timeout=30).text

    def total(name: str, **labels) -> float:
        value = 0.0
        for line in text.splitlines():
            if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
                value += float(line.rsplit(" ", 1)[1])
        return value

    assert total("carpool:structured_output_requests_total", kind="json") >= 1
    assert total("carpool:grammar_compile_seconds_count") >= 1
    assert total("carpool:grammar_cache_hits_total") >= 1  # the same schema again, on some replica
