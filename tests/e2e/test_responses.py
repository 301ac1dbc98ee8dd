"""The Responses API (``/v1/responses``) end to end: real Ray Serve, one SmolLM2 replica (eager),
the real ``openai`` client (``client.responses``).

* plain: the text and usage equal those of ``/v1/chat/completions`` for the same messages
  (greedy), ``GET`` returns the stored response, ``DELETE`` forgets it, ``store: false`` keeps nothing;
* streamed: the typed events in OpenAI's order, ``sequence_number`` 0, 1, 2, ..., the deltas
  adding up to the final text; a stream closed early leaves no request running (conftest);
* ``text.format`` with a JSON schema at temperature 1: every reply validates;
* a function tool round trip: a named call as a ``function_call`` item (streamed too, with the
  arguments events), its ``function_call_output`` sent back by ``previous_response_id``, and the
  same conversation sent as explicit items gives the same prompt;
* a follow-up by ``previous_response_id`` has the prompt of the whole history sent as chat;
* bad input gets OpenAI's 4xx naming the field: an unknown ``previous_response_id`` (400, as OpenAI),
  unsupported items, parts and tools, ``background``, a conversation larger than the store.

The cache hits and routing of follow-ups on 2 nodes, and a stored response outliving the replica
that made it: ``tests/e2e/test_prefix_routing.py``. After every test the replica is idle with
every KV block free (conftest).
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from cluster.config import ServeConfig
from replica.config.engine_config import EngineConfig

ENGINE = EngineConfig(dtype="auto", max_num_seqs=8, max_model_len=1024, num_blocks=160, compile=False)
STORE_BYTES = 16 * 1024
CONFIG = ServeConfig(app_name="e2e-responses", engine=ENGINE, response_store_max_bytes=STORE_BYTES)
QUESTION = "Name three colours of the rainbow."
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer", "minimum": 0, "maximum": 10**8}},
    "required": ["city", "population"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function", "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
                   "additionalProperties": False},
}
STREAM_ORDER = [
    "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
    "response.output_text.delta", "response.output_text.done", "response.content_part.done",
    "response.output_item.done", "response.completed",
]


@pytest.fixture(scope="module")
def served(deploy):
    with deploy(CONFIG, replicas=1) as served:
        yield served


def collapsed(types: list[str]) -> list[str]:
    """The event types with each run of deltas as one."""
    return [t for i, t in enumerate(types) if not (t.endswith(".delta") and i and types[i - 1] == t)]


def test_plain_response_is_the_chat_reply_and_is_stored(served):
    client = served.client
    response = client.responses.create(
        model=served.model, instructions="Answer briefly.", input=QUESTION, temperature=0, max_output_tokens=12,
    )
    chat = client.chat.completions.create(
        model=served.model, temperature=0, max_tokens=12,
        messages=[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}],
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == chat.choices[0].message.content and response.output_text
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert response.store and response.instructions == "Answer briefly."
    stored = client.responses.retrieve(response.id)
    assert stored.model_dump() == response.model_dump()
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(response.id)
    unstored = client.responses.create(model=served.model, input=QUESTION, max_output_tokens=4, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_streamed_events_come_in_order(served):
    events = list(served.client.responses.create(
        model=served.model, input=QUESTION, temperature=0, max_output_tokens=16, stream=True,
    ))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert collapsed(types) == STREAM_ORDER[:-1] + ["response.completed" if final.status == "completed" else "response.incomplete"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and text == final.output_text == events[types.index("response.output_text.done")].text
    assert served.client.responses.retrieve(final.id).output_text == text
    assert final.usage.output_tokens > 0


def test_a_stream_closed_early_ends_its_request(served):
    stream = served.client.responses.create(model=served.model, input="Count from one to a thousand.", max_output_tokens=600, stream=True)
    for event in stream:
        if event.type == "response.output_text.delta":
            break
    stream.close()  # the conftest check after the test: nothing left running, every block free


def test_json_schema_holds_under_sampling(served):
    fmt = {"format": {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}}
    for seed in range(3):
        response = served.client.responses.create(
            model=served.model, input="Describe a big city as JSON.", text=fmt, temperature=1, extra_body={"seed": seed}, max_output_tokens=64,
        )
        jsonschema.validate(json.loads(response.output_text), SCHEMA)


def test_a_function_tool_round_trip(served):
    client = served.client
    first = client.responses.create(
        model=served.model, input="What is the weather in Paris?", tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"}, temperature=0, max_output_tokens=48,
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    result = {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"celsius": 21, "sky": "sunny"})}
    second = client.responses.create(
        model=served.model, previous_response_id=first.id, input=[result], tools=[WEATHER], tool_choice="none",
        temperature=0, max_output_tokens=24,
    )
    assert second.output_text and second.previous_response_id == first.id
    # The same conversation as explicit items, stored nowhere: the same prompt and reply.
    items = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments}, result,
    ]
    explicit = client.responses.create(
        model=served.model, input=items, tools=[WEATHER], tool_choice="none", temperature=0, max_output_tokens=24, store=False,
    )
    assert explicit.usage.input_tokens == second.usage.input_tokens
    assert explicit.output_text == second.output_text


def test_a_streamed_function_call(served):
    events = list(served.client.responses.create(
        model=served.model, input="What is the weather in Rome?", tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"}, temperature=0, max_output_tokens=48, stream=True,
    ))
    assert collapsed([e.type for e in events]) == [
        "response.created", "response.in_progress", "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed",
    ]
    done = events[-2].item
    assert done.type == "function_call" and done.name == "get_weather"
    assert done.arguments == "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    jsonschema.validate(json.loads(done.arguments), WEATHER["parameters"])


def test_a_follow_up_has_the_prompt_of_the_whole_history(served):
    client = served.client
    first = client.responses.create(model=served.model, input=QUESTION, temperature=0, max_output_tokens=12)
    second = client.responses.create(
        model=served.model, previous_response_id=first.id, input="And two more?", temperature=0, max_output_tokens=12,
    )
    history = [
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And two more?"},
    ]
    chat = client.chat.completions.create(model=served.model, messages=history, temperature=0, max_tokens=12)
    assert second.usage.input_tokens == chat.usage.prompt_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.output_text == chat.choices[0].message.content


BAD = [
    ({"previous_response_id": "resp_unknown"}, 400, "previous_response_id", "Previous response with id 'resp_unknown' not found."),
    ({"input": [{"type": "reasoning", "summary": []}]}, 400, "input.0.type", None),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, 400, "input.0.content.0.type", None),
    ({"input": [{"role": "robot", "content": "hi"}]}, 400, "input.0.role", None),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, 400, "input.0.call_id", None),
    ({"background": True}, 400, "background", None),
    ({"truncation": "auto"}, 400, "truncation", None),
    ({"tools": [{"type": "web_search"}]}, 400, "tools.0.type", None),
    ({"tools": [{"type": "function", "name": "f", "parameters": []}]}, 400, "tools.0.parameters", None),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format.schema", None),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, 400, "text.format.schema", None),
    ({"max_output_tokens": 5000}, 400, "max_output_tokens", None),
    ({"input": "x" * (STORE_BYTES + 10)}, 400, "input", None),
]


@pytest.mark.parametrize("fields, status, param, message", BAD, ids=[b[2] + "-" + str(i) for i, b in enumerate(BAD)])
def test_bad_input_gets_openai_errors(served, fields, status, param, message):
    import httpx

    body = {"model": served.model, "input": "hi", "max_output_tokens": 4, **fields}
    reply = httpx.post(served.base_url + "/responses", json=body, timeout=60)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["code"], error
    if message is not None:
        assert error["message"] == message
    if fields.get("input", "").startswith("xxx") if isinstance(fields.get("input"), str) else False:
        assert error["code"] == "response_too_large"


def test_lone_surrogates_sent_back_are_escaped_not_a_500(served):
    # JSON's "\ud800" parses to a lone surrogate, which UTF-8 cannot encode: a field echoed back
    # (metadata, user) or named in an error (previous_response_id, model) must come back as the
    # same escape, in a 200 or OpenAI's error shape.
    import httpx

    head = {"content-type": "application/json"}
    raw = '{"model": "%s", "input": "hi", "max_output_tokens": 2, "metadata": {"k": "\\ud800"}, "user": "\\udfff"}'
    reply = httpx.post(served.base_url + "/responses", content=raw % served.model, headers=head, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["metadata"] == {"k": "\ud800"} and reply.json()["user"] == "\udfff"
    stored = httpx.get(served.base_url + "/responses/" + reply.json()["id"], timeout=60)
    assert stored.status_code == 200 and stored.json() == reply.json()
    raw = '{"model": "%s", "input": "hi", "previous_response_id": "resp_\\ud800"}'
    reply = httpx.post(served.base_url + "/responses", content=raw % served.model, headers=head, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "previous_response_id"
    raw = '{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}'
    reply = httpx.post(served.base_url + "/chat/completions", content=raw, headers=head, timeout=60)
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"


def test_a_streamed_get_is_a_400(served):
    # Not the JSON body, which client.responses.retrieve(id, stream=True) reads as no events.
    import httpx

    reply = httpx.get(served.base_url + "/responses/resp_unknown", params={"stream": "true"}, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "stream", reply.text
