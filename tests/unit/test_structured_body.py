"""Output constraints and tool plans from request bodies (router/request/structured.py): which
``StructuredOutputsParams`` each source gives, the ``required`` / named tool schemas, and the
400s naming the field at fault. No tokenizer, no replica: llguidance compiles without one."""

from __future__ import annotations

import json

import jsonschema
import pytest

from replica.protocol.constraints import StructuredOutputsParams
from router.request.preparation import RequestPreparer
from router.request.protocol import ChatCompletionRequest, CompletionRequest, OpenAIError
from router.request.structured import ToolPlan, chat_constraints, constraint_of, tool_plan

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"], "additionalProperties": False},
    },
}
NO_PARAMS = {"type": "function", "function": {"name": "ping"}}


def chat(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=MESSAGES, **body)


def completion(**body) -> CompletionRequest:
    return CompletionRequest(model="m", prompt="Hi", **body)


def refused(fn, body) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        fn(body)
    assert info.value.status_code == 400
    return info.value


# ---- constraint_of: sources ------------------------------------------------------------------------


@pytest.mark.parametrize("make", [chat, completion])
@pytest.mark.parametrize(
    "body, kind, value",
    [
        ({"response_format": {"type": "json_object"}}, "json_object", True),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}}, "json", SCHEMA),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "c.ity-1_x", "strict": True, "schema": SCHEMA}}}, "json", SCHEMA),
        ({"structured_outputs": {"json": SCHEMA}}, "json", SCHEMA),
        ({"structured_outputs": {"json_object": True}}, "json_object", True),
        ({"structured_outputs": {"regex": "[0-9]{3}"}}, "regex", "[0-9]{3}"),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", ["yes", "no"]),
        ({"structured_outputs": {"grammar": 'start: "a" | "b"'}}, "grammar", 'start: "a" | "b"'),
        # null / false fields next to the one set are ignored (vLLM sends its defaults)
        ({"structured_outputs": {"regex": "a+", "json": None, "json_object": False}}, "regex", "a+"),
        ({"guided_json": SCHEMA}, "json", SCHEMA),
        ({"guided_regex": "a|b"}, "regex", "a|b"),
        ({"guided_choice": ["x", "y"]}, "choice", ["x", "y"]),
        ({"guided_grammar": 'start: "z"'}, "grammar", 'start: "z"'),
    ],
)
def test_each_source_gives_its_kind(make, body, kind, value):
    params = constraint_of(make(**body))
    assert isinstance(params, StructuredOutputsParams)
    assert params.kind == kind
    assert getattr(params, kind) == value
    assert params.source.split(".")[0] == next(iter(body))  # the replica's errors name the client's field


@pytest.mark.parametrize("body", [{}, {"response_format": {"type": "text"}}, {"guided_json": None}])
def test_no_constraint(body):
    assert constraint_of(chat(**body)) is None


@pytest.mark.parametrize(
    "body",
    [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": json.dumps(SCHEMA)}}},
        {"structured_outputs": {"json": json.dumps(SCHEMA)}},
        {"guided_json": json.dumps(SCHEMA)},
    ],
)
def test_schema_as_json_text_is_parsed(body):
    params = constraint_of(chat(**body))
    assert params.kind == "json" and params.json == SCHEMA  # the parsed object, not the text


def test_text_format_next_to_another_source_is_not_a_conflict():
    params = constraint_of(chat(response_format={"type": "text"}, guided_regex="[ab]"))
    assert params.kind == "regex" and params.regex == "[ab]"


# ---- constraint_of: refusals -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, param",
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {}}, "response_format.type"),
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format.json_schema.name"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "has space", "schema": SCHEMA}}}, "response_format.json_schema.name"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x" * 65, "schema": SCHEMA}}}, "response_format.json_schema.name"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "", "schema": SCHEMA}}}, "response_format.json_schema.name"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "strict": "yes", "schema": SCHEMA}}}, "response_format.json_schema.strict"),
        # a schema that is not an object, not JSON, or that llguidance cannot compile
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": [1]}}}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": "{not json"}}}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "nonsense"}}}}, "response_format.json_schema.schema"),
        ({"structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs.json"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
        ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "start: ((("}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": "a+"}, "structured_outputs"),
        ({"guided_json": {"properties": {"a": {"$ref": "#/nope"}}}}, "guided_json"),
        ({"guided_json": "[1, 2]"}, "guided_json"),
        ({"guided_regex": "("}, "guided_regex"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_grammar": "start: ((("}, "guided_grammar"),
        ({"guided_choice": "yes"}, "guided_choice"),
        ({"guided_choice": ["yes", "a" * 100_001]}, "guided_choice"),  # past what llguidance's lexer walks
    ],
)
def test_bad_constraint_is_a_400_naming_its_field(body, param):
    error = refused(constraint_of, chat(**body))
    assert error.param == param
    assert str(error).startswith(param + ":")


@pytest.mark.parametrize(
    "body, param",
    [
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"regex": "a"}, "guided_json": SCHEMA}, "guided_json"),
        ({"structured_outputs": {"json": SCHEMA}, "guided_choice": ["a"]}, "guided_choice"),
        ({"guided_json": SCHEMA, "guided_grammar": 'start: "a"'}, "guided_grammar"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}, "guided_choice": ["a"]}, "guided_choice"),
    ],
)
def test_two_sources_is_a_400_naming_the_second(body, param):
    error = refused(constraint_of, chat(**body))
    assert error.param == param


# ---- tool_plan ------------------------------------------------------------------------------------


def calls_validator(plan: ToolPlan) -> jsonschema.protocols.Validator:
    schema = plan.constraint.json
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_no_tools_no_plan():
    assert tool_plan(chat()) is None
    assert tool_plan(chat(tool_choice="none")) is None
    assert tool_plan(chat(tools=[])) is None


def test_tools_default_to_auto_without_constraint():
    plan = tool_plan(chat(tools=[WEATHER, TIME]))
    assert (plan.mode, plan.name, plan.parallel, plan.constraint) == ("auto", None, True, None)
    assert plan.tools == [WEATHER, TIME]
    assert tool_plan(chat(tools=[WEATHER], tool_choice="auto")).mode == "auto"


def test_none_renders_no_tools():
    plan = tool_plan(chat(tools=[WEATHER, TIME], tool_choice="none"))
    assert plan.mode == "none" and plan.tools == [] and plan.constraint is None


def test_required_is_an_array_of_calls():
    plan = tool_plan(chat(tools=[WEATHER, TIME, NO_PARAMS], tool_choice="required"))
    assert plan.mode == "required" and plan.constraint.kind == "json"
    schema = plan.constraint.json
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    v = calls_validator(plan)
    good = [
        {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}},
        {"name": "get_time", "arguments": {"zone": "CET"}},
        {"name": "ping", "arguments": {}},
    ]
    assert v.is_valid(good) and v.is_valid(good[:1])
    assert not v.is_valid([])  # at least one call
    assert not v.is_valid([{"name": "get_stock", "arguments": {"city": "Paris"}}])  # an unknown function
    assert not v.is_valid([{"name": "get_weather", "arguments": {"zone": "CET"}}])  # another tool's arguments
    assert not v.is_valid([{"name": "get_weather", "arguments": {"city": 3}}])  # a wrong type
    assert not v.is_valid([{"name": "get_weather", "arguments": {"city": "Paris", "unit": "K"}}])  # outside the enum
    assert not v.is_valid([{"name": "get_weather"}])  # no arguments
    assert not v.is_valid([{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "x"}])  # an extra key
    assert not v.is_valid({"name": "get_weather", "arguments": {"city": "Paris"}})  # not an array


def test_required_with_one_tool():
    v = calls_validator(tool_plan(chat(tools=[WEATHER], tool_choice="required")))
    assert v.is_valid([{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_weather", "arguments": {"city": "Rome"}}])
    assert not v.is_valid([{"name": "get_time", "arguments": {"zone": "CET"}}])


def test_required_without_parallel_calls_allows_one_call():
    plan = tool_plan(chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False))
    assert plan.parallel is False and plan.constraint.json["maxItems"] == 1
    v = calls_validator(plan)
    one = {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert v.is_valid([one]) and not v.is_valid([one, one])


def test_named_is_the_functions_parameters():
    plan = tool_plan(chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert (plan.mode, plan.name) == ("named", "get_time")
    assert plan.constraint.kind == "json" and plan.constraint.json == TIME["function"]["parameters"]
    plan = tool_plan(chat(tools=[WEATHER, NO_PARAMS], tool_choice={"type": "function", "function": {"name": "ping"}}))
    assert plan.constraint.json == {"type": "object", "properties": {}}  # no parameters: any object


def test_parameters_as_json_text_are_accepted():
    text_tool = {"type": "function", "function": {"name": "get_weather", "parameters": json.dumps(WEATHER["function"]["parameters"])}}
    plan = tool_plan(chat(tools=[text_tool], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert plan.mode == "named"
    plan = tool_plan(chat(tools=[text_tool], tool_choice="required"))  # the array schema embeds the parsed schema
    v = calls_validator(plan)
    assert v.is_valid([{"name": "get_weather", "arguments": {"city": "Paris"}}])
    assert not v.is_valid([{"name": "get_weather", "arguments": {"city": 1}}])


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": ["get_weather"]}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": {"n": 1}}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"function": {"name": "get_weather"}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "any"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": 1}, "tool_choice"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [], "tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
        ({"tools": WEATHER}, "tools"),
        ({"tools": [WEATHER, "get_time"]}, "tools.1"),
        ({"tools": [{"type": "retrieval", "function": WEATHER["function"]}]}, "tools.0"),
        ({"tools": [{"type": "function"}]}, "tools.0"),
        ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "function", "function": {"parameters": SCHEMA}}]}, "tools.0.function.name"),
        ({"tools": [TIME, {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]}, "tools.1.function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{not json"}}]}, "tools.0.function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools.0.function.parameters"),
    ],
)
def test_bad_tools_are_a_400_naming_the_field(body, param):
    error = refused(tool_plan, chat(**body))
    assert error.param == param
    assert str(error).startswith(param + ":")


# ---- the chat request's one constraint (structured.chat_constraints) ---------------------------------


def test_tool_choice_constraint_wins_and_formats_conflict_with_tools():
    plan, constraint = chat_constraints(chat(tools=[WEATHER], tool_choice="required"))
    assert constraint is plan.constraint and constraint.json["type"] == "array"
    plan, constraint = chat_constraints(chat(tools=[WEATHER], tool_choice="none", guided_regex="a+"))
    assert plan.mode == "none" and constraint.regex == "a+"
    plan, constraint = chat_constraints(chat(tools=[WEATHER]))
    assert plan.mode == "auto" and constraint is None
    for choice in ("auto", "required", {"type": "function", "function": {"name": "get_weather"}}):
        error = refused(chat_constraints, chat(tools=[WEATHER], tool_choice=choice, response_format={"type": "json_object"}))
        assert error.param == "response_format"


def test_constraints_are_checked_on_their_own_threads_not_the_tokenizers(smollm2_tokenizer, monkeypatch):
    """A slow constraint (a schema or list of megabytes) holds up only other constraints: the
    default pool that tokenizes every request's prompt stays free."""
    import asyncio
    import threading

    import router.request.preparation
    import router.request.structured
    from router.config import IngressConfig

    seen: list[str] = []

    def recording(body):
        seen.append(threading.current_thread().name)
        return constraint_of(body)

    monkeypatch.setattr(router.request.preparation, "constraint_of", recording)  # completions
    monkeypatch.setattr(router.request.structured, "constraint_of", recording)  # chat, through chat_constraints
    preparer = RequestPreparer(IngressConfig(), smollm2_tokenizer, "m")
    info = {"max_model_len": 256, "vocab_size": 49152, "block_size": 16}
    body = CompletionRequest(model="m", prompt="Pick:", guided_choice=["yes", "no"])
    prepared = asyncio.run(preparer.completion(body, info))
    assert prepared.params[0][0].structured_outputs == StructuredOutputsParams(choice=["yes", "no"], field="guided_choice")
    asyncio.run(preparer.chat(chat(guided_regex="a+"), info))
    assert len(seen) == 2 and all(name.startswith("carpool-constraint") for name in seen)
