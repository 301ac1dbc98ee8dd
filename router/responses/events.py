"""A streamed response's typed events, built from the chat path's ``chat.completion.chunk``
events (:meth:`router.response.responses.ResponseFormatter.chat_events`).

Order, as OpenAI sends them (every event has ``type`` and ``sequence_number``, from 0):
``response.created``, ``response.in_progress``; for each output item in turn,
``response.output_item.added``, then for a message ``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``, ``response.content_part.done``,
and for a function call ``response.function_call_arguments.delta``...,
``response.function_call_arguments.done``; then ``response.output_item.done``; last
``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut it,
``response.failed`` when a replica failed). A message item opens at the reply's first text and
closes when a call starts (text after a call opens another message item).

SSE framing (:func:`sse_frames`): ``event: <type>`` and ``data: <json>`` per event, no
``[DONE]``, as OpenAI's stream. The JSON is ASCII (``\\u`` escapes), so no frame holds a
character that a client's line splitting would cut at.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from router.responses.items import call_item, message_item, new_id


class EventBuilder:
    """Turns chat chunks into Responses events, keeping the reply's items.

    Args:
        skeleton: the response object before any output (status ``in_progress``), copied into
            the first two events.
    """

    def __init__(self, skeleton: dict[str, Any]) -> None:
        self.skeleton = skeleton
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # items closed so far, in order
        self._message: dict[str, Any] | None = None  # the open message item
        self._text: list[str] = []
        self._call: dict[str, Any] | None = None  # the open function_call item
        self._calls: list[dict[str, Any]] = []  # every call, in the chat shape
        self.texts: list[str] = []  # every text piece
        self.finish_reason: str | None = None
        self.usage: dict[str, int] | None = None

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def opening(self) -> list[dict[str, Any]]:
        return [self.event("response.created", response=self.skeleton), self.event("response.in_progress", response=self.skeleton)]

    def chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat chunk (its usage and finish reason are kept)."""
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        events: list[dict[str, Any]] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._add_text(delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._add_call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    def closing(self) -> list[dict[str, Any]]:
        """Close the open item (the reply ended)."""
        return self._close_message() + self._close_call()

    def assistant_message(self) -> dict[str, Any]:
        """The reply as a chat message (what a follow-up's conversation holds)."""
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.texts) or (None if self._calls else "")}
        if self._calls:
            message["tool_calls"] = self._calls
        return message

    def _status(self) -> str:
        return "incomplete" if self.finish_reason == "length" else "completed"

    def _add_text(self, text: str) -> list[dict[str, Any]]:
        events = self._close_call()
        index = len(self.output)
        if self._message is None:
            self._message = message_item("", new_id("msg"), "in_progress")
            self._message["content"] = []
            self._text = []
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(self.event("response.output_item.added", output_index=index, item=self._message))
            events.append(self.event("response.content_part.added", item_id=self._message["id"], output_index=index,
                                     content_index=0, part=part))
        self._text.append(text)
        self.texts.append(text)
        events.append(self.event("response.output_text.delta", item_id=self._message["id"], output_index=index,
                                 content_index=0, delta=text, logprobs=[]))
        return events

    def _close_message(self) -> list[dict[str, Any]]:
        if self._message is None:
            return []
        index, text = len(self.output), "".join(self._text)
        item = message_item(text, self._message["id"], self._status())
        part = item["content"][0]
        events = [
            self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0, text=text, logprobs=[]),
            self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part),
            self.event("response.output_item.done", output_index=index, item=item),
        ]
        self.output.append(item)
        self._message = None
        return events

    def _add_call(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        pieces = (delta.get("function") or {}).get("arguments") or ""
        if delta.get("id"):  # a new call (its first delta)
            events += self._close_message() + self._close_call()
            call = {"id": delta["id"], "type": "function", "function": {"name": delta["function"]["name"], "arguments": ""}}
            self._calls.append(call)
            self._call = call_item(call, new_id("fc"), "in_progress")
            events.append(self.event("response.output_item.added", output_index=len(self.output), item=dict(self._call)))
        if pieces and self._call is not None:
            self._calls[-1]["function"]["arguments"] += pieces
            self._call["arguments"] += pieces
            events.append(self.event("response.function_call_arguments.delta", item_id=self._call["id"],
                                     output_index=len(self.output), delta=pieces))
        return events

    def _close_call(self) -> list[dict[str, Any]]:
        if self._call is None:
            return []
        item, index = {**self._call, "status": "completed"}, len(self.output)
        events = [
            self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                       arguments=item["arguments"], name=item["name"]),
            self.event("response.output_item.done", output_index=index, item=item),
        ]
        self.output.append(item)
        self._call = None
        return events


async def sse_frames(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """``event: <type>`` and ``data: <json>`` per event, as OpenAI's Responses stream (no ``[DONE]``)."""
    async for event in events:
        yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
