"""A Responses-API turn without a cluster (``router/responses/api.py``): the chat request a body
becomes, a stored conversation continued, a streamed reply that a replica failure ends with
``response.failed``, and a record the store refuses (the response then says ``store: false``)."""

from __future__ import annotations

import asyncio
import json

import pytest

from router.request.protocol import OpenAIError
from router.responses.api import ResponsesAPI
from router.responses.protocol import ResponsesRequest
from router.responses.store import MemoryStore, RecordTooLarge


class Store:
    """The in-memory LRU behind the async interface, as the deployment's client gives it."""

    def __init__(self, max_bytes: int = 10**6) -> None:
        self.memory = MemoryStore(max_bytes, ttl_s=60)

    async def put(self, key: str, value: bytes) -> None:
        self.memory.put(key, value)

    async def get(self, key: str) -> bytes | None:
        return self.memory.get(key)

    async def delete(self, key: str) -> bool:
        return self.memory.delete(key)


def chat_body(text: str, finish: str = "stop") -> dict:
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}


def test_a_follow_up_continues_the_stored_conversation_behind_its_own_instructions():
    api = ResponsesAPI(Store(), "m", 10**6)
    first = asyncio.run(api.begin(ResponsesRequest(input="Hi", instructions="Be brief.", max_output_tokens=8, temperature=0)))
    assert [m.model_dump(exclude_none=True) for m in first.chat.messages] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert first.chat.max_completion_tokens == 8 and first.chat.temperature == 0
    response = asyncio.run(api.finish(first, chat_body("Hello.", "length")))
    assert response["status"] == "incomplete" and response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["usage"]["input_tokens"] == 5 and response["output"][0]["content"][0]["text"] == "Hello."
    second = asyncio.run(api.begin(ResponsesRequest(input="More?", instructions="Be kind.", previous_response_id=first.id)))
    assert [(m.role, m.content) for m in second.chat.messages] == [
        ("system", "Be kind."), ("user", "Hi"), ("assistant", "Hello."), ("user", "More?")]
    assert second.origins == ["instructions", "previous_response_id", "previous_response_id", "input"]
    assert asyncio.run(api.retrieve(first.id)) == response
    assert asyncio.run(api.delete(first.id))["deleted"]
    with pytest.raises(OpenAIError) as err:
        asyncio.run(api.begin(ResponsesRequest(input="x", previous_response_id=first.id)))
    assert err.value.status_code == 400 and err.value.code == "previous_response_not_found"


def test_a_record_the_store_refuses_leaves_the_response_unstored():
    api = ResponsesAPI(Store(max_bytes=2000), "m", 2000)
    turn = asyncio.run(api.begin(ResponsesRequest(input="Hi")))
    response = asyncio.run(api.finish(turn, chat_body("x" * 3000)))
    assert response["store"] is False and response["output"][0]["content"][0]["text"] == "x" * 3000
    with pytest.raises(OpenAIError) as err:
        asyncio.run(api.retrieve(turn.id))
    assert err.value.status_code == 404
    with pytest.raises(OpenAIError) as err:  # a conversation past the bound is refused before generating
        asyncio.run(api.begin(ResponsesRequest(input="y" * 2100)))
    assert (err.value.status_code, err.value.code, err.value.param) == (400, "response_too_large", "input")
    assert issubclass(RecordTooLarge, ValueError)


def test_without_a_store_nothing_is_kept_and_follow_ups_are_refused():
    api = ResponsesAPI(None, "m", 10**6)
    turn = asyncio.run(api.begin(ResponsesRequest(input="Hi")))
    assert asyncio.run(api.finish(turn, chat_body("Hello.")))["store"] is False
    with pytest.raises(OpenAIError, match="stores no responses"):
        asyncio.run(api.begin(ResponsesRequest(input="x", previous_response_id="resp_1")))


async def _collect(api, turn, chunks):
    async def source():
        for c in chunks:
            yield c
    return [e async for e in api.events(turn, source())]


def test_a_replica_failure_ends_the_stream_with_response_failed_and_stores_nothing():
    store = Store()
    api = ResponsesAPI(store, "m", 10**6)
    turn = asyncio.run(api.begin(ResponsesRequest(input="Hi", stream=True)))
    assert turn.chat.stream_options.include_usage
    text = {"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]}
    error = {"error": {"message": "the replica died", "type": "server_error", "param": None, "code": "replica_failed"}}
    events = asyncio.run(_collect(api, turn, [text, error]))
    assert [e["type"] for e in events][-2:] == ["response.output_text.delta", "response.failed"]
    assert events[-1]["response"]["error"] == {"code": "replica_failed", "message": "the replica died"}
    assert store.memory.get(turn.id) is None
    done = asyncio.run(_collect(api, turn, [text, {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}]))
    assert done[-1]["type"] == "response.completed" and json.loads(store.memory.get(turn.id))["response"] == done[-1]["response"]


def test_a_streamed_get_is_refused_not_answered_as_json():
    # The openai client's retrieve(id, stream=True) reads the JSON body as an empty event stream.
    api = ResponsesAPI(None, "m", 1 << 20)
    for value in ("true", "1", "True"):
        with pytest.raises(OpenAIError) as err:
            asyncio.run(api.retrieve("resp_x", value))
        assert err.value.status_code == 400 and err.value.param == "stream"
    with pytest.raises(OpenAIError) as err:
        asyncio.run(api.retrieve("resp_x", "false"))
    assert err.value.status_code == 404


def test_a_store_that_fails_is_a_503_to_retry_not_a_500():
    """The store's replica restarting (or an external store down) while a follow-up, GET or DELETE
    reads it."""

    class Down(Store):
        async def get(self, key: str) -> bytes | None:
            raise ConnectionError("store replica restarting")

        async def delete(self, key: str) -> bool:
            raise ConnectionError("store replica restarting")

    api = ResponsesAPI(Down(), "m", 10**6)
    for call in (api.begin(ResponsesRequest(input="x", previous_response_id="resp_1")), api.retrieve("resp_1"), api.delete("resp_1")):
        with pytest.raises(OpenAIError) as err:
            asyncio.run(call)
        assert err.value.status_code == 503 and "retry" in err.value.message
