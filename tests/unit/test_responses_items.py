"""The Responses API's items and events (``router/responses/``): input items to chat messages,
tools, tool choice and text format to the chat request's fields, a chat reply to output items, the
typed events of a streamed reply in OpenAI's order, and the chat path's errors renamed."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from router.request.errors import validation_error
from router.request.protocol import OpenAIError
from router.responses.api import responses_error
from router.responses.events import EventBuilder
from router.responses.items import chat_messages, chat_tool_choice, chat_tools, output_items, response_format
from router.responses.protocol import ResponsesRequest


def test_items_become_chat_messages():
    call = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": '{"a": 1}'}
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi "}, {"type": "input_text", "text": "there"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Calling."}]},
        call,
        {**call, "call_id": "call_2"},
        {"type": "function_call_output", "call_id": "call_1", "output": "42"},
    ]
    tool_call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    assert chat_messages(items) == [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Calling.", "tool_calls": [tool_call, {**tool_call, "id": "call_2"}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]
    assert chat_messages("Hello") == [{"role": "user", "content": "Hello"}]
    assert chat_messages([call])[0] == {"role": "assistant", "content": None, "tool_calls": [tool_call]}
    origins = []
    chat_messages(items, origins)
    assert origins == ["input.0", "input.1", "input.2", "input.5"]


@pytest.mark.parametrize("items, param", [
    ([{"type": "item_reference", "id": "x"}], "input.0.type"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}], "input.1.content.0.type"),
    ([{"role": "tool", "content": "a"}], "input.0.role"),
    ([{"type": "function_call", "call_id": "c", "name": "f"}], "input.0.arguments"),
    (["text"], "input.0"),
])
def test_items_not_supported_are_named(items, param):
    with pytest.raises(OpenAIError) as err:
        chat_messages(items)
    assert err.value.param == param and err.value.status_code == 400


def test_tools_tool_choice_and_format_take_the_chat_shape():
    tool = {"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}, "strict": True}
    assert chat_tools([tool]) == [{"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}]
    with pytest.raises(OpenAIError, match="tools.0.type"):
        chat_tools([{"type": "file_search"}])
    assert chat_tool_choice("required") == "required"
    assert chat_tool_choice({"type": "function", "name": "f"}) == {"type": "function", "function": {"name": "f"}}
    with pytest.raises(OpenAIError):
        chat_tool_choice({"type": "web_search_preview"})
    schema = {"type": "object"}
    assert response_format({"format": {"type": "json_schema", "name": "n", "schema": schema}}) == {
        "type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    assert response_format({"format": {"type": "text"}}) is None and response_format(None) is None
    with pytest.raises(OpenAIError, match="text.format.type"):
        response_format({"format": {"type": "yaml"}})


def test_a_reply_becomes_output_items():
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert [i["type"] for i in output_items({"content": "Hi", "tool_calls": [call]})] == ["message", "function_call"]
    assert [i["type"] for i in output_items({"content": None, "tool_calls": [call]})] == ["function_call"]
    (message,) = output_items({"content": ""})
    assert message["content"][0]["text"] == ""


def chunk(content=None, calls=None, finish=None, usage=None):
    delta = {}
    if content is not None:
        delta["content"] = content
    if calls is not None:
        delta["tool_calls"] = calls
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}] if usage is None else [], "usage": usage}


def test_events_of_text_then_a_call_come_in_order():
    builder = EventBuilder({"id": "resp_1", "status": "in_progress"})
    events = builder.opening()
    events += builder.chunk(chunk("Let me "))
    events += builder.chunk(chunk("check."))
    events += builder.chunk(chunk(calls=[{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a"'}}]))
    events += builder.chunk(chunk(calls=[{"index": 0, "function": {"arguments": ": 1}"}}], finish="tool_calls"))
    events += builder.chunk(chunk(usage={"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}))
    events += builder.closing()
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["output_index"] for e in events[2:]] == [0] * 7 + [1] * 5
    assert events[6]["text"] == "Let me check." and events[12]["arguments"] == '{"a": 1}'
    assert [i["type"] for i in builder.output] == ["message", "function_call"]
    assert builder.assistant_message() == {
        "role": "assistant", "content": "Let me check.",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
    }
    assert builder.usage["total_tokens"] == 7 and builder.finish_reason == "tool_calls"


def test_the_chat_path_s_errors_name_the_responses_fields():
    exc = responses_error(OpenAIError("response_format.json_schema.schema: bad", param="response_format.json_schema.schema"))
    assert exc.param == "text.format.schema" and exc.message == "text.format.schema: bad"
    exc = responses_error(OpenAIError("max_completion_tokens: too many. Please reduce the prompt or max_completion_tokens.",
                                      param="max_completion_tokens"))
    assert exc.param == "max_output_tokens" and exc.message == "max_output_tokens: too many. Please reduce the prompt or max_output_tokens."
    origins = ["instructions", "previous_response_id", "input.0", "input"]
    exc = responses_error(OpenAIError("messages.2.content: the chat template failed", param="messages.2.content"), origins)
    assert exc.param == "input.0.content" and exc.message == "input.0.content: the chat template failed"
    assert responses_error(OpenAIError("x", param="messages.3.content"), origins).param == "input"
    assert responses_error(OpenAIError("x", param="messages.0.content"), origins).param == "instructions"
    assert responses_error(OpenAIError("x", param="messages"), origins).param == "input"
    # A Responses tool is flat ({"type": "function", "name", "parameters"}): no "function" level.
    exc = responses_error(OpenAIError("tools.1.function.parameters: bad", param="tools.1.function.parameters"))
    assert exc.param == "tools.1.parameters" and exc.message == "tools.1.parameters: bad"
    assert responses_error(OpenAIError("n: bad", param="tools.0.function.name")).param == "tools.0.name"


@pytest.mark.parametrize("value", [5, None, True, {"role": "user", "content": "hi"}])
def test_an_input_neither_text_nor_items_is_named_input(value):
    # Not pydantic's union member ("input.str") with "(and 1 more errors)": the field itself.
    with pytest.raises(ValidationError) as err:
        ResponsesRequest.model_validate({"input": value})
    exc = validation_error(err.value.errors())
    assert exc.param == "input" and exc.message == "input: must be a string or a list of input items", exc.message
