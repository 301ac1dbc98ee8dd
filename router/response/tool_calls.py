"""Tool calls out of a chat reply's text, whole (:func:`parse_reply`) or as it streams
(:class:`ToolCallStream`).

What the text holds depends on the request's :class:`~router.request.structured.ToolPlan`:

* ``named``: the function's arguments, one JSON object (the reply was constrained to it);
* ``required``: a JSON array of ``{"name", "arguments"}`` calls (constrained likewise);
* ``auto``: free text in which the model may call tools in its family's format. One parser so
  far, ``hermes``: each call is a JSON object ``{"name": ..., "arguments": {...}}`` (or a list of
  them, as SmolLM2 writes) between ``<tool_call>`` and ``</tool_call>``; the format of Hermes,
  Qwen 2/2.5/3 and SmolLM2, and the one Carpool's ChatML tool template asks for
  (``router/request/templates/chatml_tools.jinja``). Text outside the tags is the reply's content.

A call comes out as OpenAI's ``{"id": "call_...", "type": "function", "function": {"name",
"arguments"}}``, ``arguments`` being JSON text. Streamed, a named function's arguments flow as
they are written; under ``required`` and ``auto`` each call is sent whole as soon as its JSON is
complete (one ``tool_calls`` delta with its index, id, name and arguments).
"""

# No "from __future__ import annotations", as in router/ingress.py.

import json
import uuid
from typing import Any

from router.request.structured import ToolPlan

PARSERS = ("hermes",)
"""Tool-call formats :class:`ToolCallStream` reads in ``auto`` mode (``--tool-call-parser``)."""

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def new_call(name: str, arguments: str) -> dict[str, Any]:
    """An OpenAI tool call with a fresh id; ``arguments`` is JSON text."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": arguments}}


def _calls_of(value: Any) -> list[dict[str, Any]] | None:
    """Tool calls from a parsed JSON object (or list of them) with ``name`` and ``arguments`` (or
    ``parameters``); None if it is not shaped so."""
    items = value if isinstance(value, list) else [value]
    if not items:
        return None
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        calls.append(new_call(item["name"], text))
    return calls


def array_items(text: str) -> tuple[list[str], int]:
    """The complete top-level items of a JSON array that ``text`` starts (possibly unfinished):
    ``(items' texts, end offset of the last complete one)``. Strings and escapes are respected."""
    items: list[str] = []
    depth, in_string, escaped, start, end = 0, False, False, None, 0
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
            continue
        if ch == '"':
            in_string = True
            if depth == 1 and start is None:
                start = i
        elif ch in "[{":
            depth += 1
            if depth == 2 and start is None:
                start = i
        elif ch in "]}":
            depth -= 1
            if depth == 1 and start is not None:
                items.append(text[start : i + 1])
                start, end = None, i + 1
            if depth == 0:
                break
    return items, end


class ToolCallStream:
    """Tool calls and content from a reply's text, fed delta by delta.

    Args:
        plan: the request's tool plan (mode ``named``, ``required`` or ``auto``).
        parser: the ``auto`` format, one of :data:`PARSERS`.
    """

    def __init__(self, plan: ToolPlan, parser: str = "hermes") -> None:
        if parser not in PARSERS:
            raise ValueError(f"unknown tool call parser {parser!r}; known: {', '.join(PARSERS)}")
        self.plan = plan
        self.buffer = ""  # text not yet turned into content or calls
        self.calls: list[dict[str, Any]] = []  # every call so far
        self.content: list[str] = []  # every content piece so far
        self._named_id: str | None = None
        self._array_done = 0  # required: the array's items handled so far

    def feed(self, text: str, finished: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """Take the next piece of the reply; return ``(content delta, tool_calls deltas)``.

        ``finished``: this is the last piece; whatever is held back comes out (an unclosed
        ``<tool_call>`` whose JSON does not parse is content).
        """
        mode = self.plan.mode
        if mode == "named":
            return "", self._named(text)
        self.buffer += text
        if mode == "required":
            return "", self._required()
        return self._auto(finished)

    def _named(self, text: str) -> list[dict[str, Any]]:
        if self._named_id is None:
            call = new_call(self.plan.name, text)
            self._named_id = call["id"]
            self.calls.append(call)
            return [{"index": 0, **call, "function": dict(call["function"])}]  # later pieces extend the stored call
        self.calls[0]["function"]["arguments"] += text
        return [{"index": 0, "function": {"arguments": text}}] if text else []

    def _required(self) -> list[dict[str, Any]]:
        items, _ = array_items(self.buffer)
        deltas = []
        for item in items[self._array_done:]:
            self._array_done += 1
            for call in _parse_json_calls(item) or []:
                deltas.append({"index": len(self.calls), **call})
                self.calls.append(call)
        return deltas

    def _auto(self, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        content, deltas = [], []
        while True:
            start = self.buffer.find(OPEN)
            if start < 0:
                keep = 0 if finished else _partial_suffix(self.buffer, OPEN)
                content.append(self.buffer[: len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep :]
                break
            stop = self.buffer.find(CLOSE, start)
            if stop < 0 and not finished:
                content.append(self.buffer[:start])
                self.buffer = self.buffer[start:]
                break
            body = self.buffer[start + len(OPEN) : stop if stop >= 0 else len(self.buffer)]
            calls = _parse_json_calls(body)
            if calls is None:  # not a call after all: it stays text
                content.append(self.buffer[: stop + len(CLOSE)] if stop >= 0 else self.buffer)
            else:
                content.append(self.buffer[:start])
                for call in calls:
                    deltas.append({"index": len(self.calls), **call})
                    self.calls.append(call)
            self.buffer = self.buffer[stop + len(CLOSE) :] if stop >= 0 else ""
            if stop < 0:
                break
        text = "".join(content)
        if deltas and not text.strip():  # only the blank lines around this piece's calls
            text = ""
        if text:
            self.content.append(text)
        return text, deltas


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _parse_json_calls(body: str) -> list[dict[str, Any]] | None:
    try:
        return _calls_of(json.loads(body.strip()))
    except (ValueError, RecursionError):  # RecursionError: JSON nested too deep to parse
        return None


def parse_reply(text: str, plan: ToolPlan, parser: str = "hermes") -> tuple[str | None, list[dict[str, Any]]]:
    """A whole reply's ``(content, tool calls)``; content None when the reply is calls only."""
    stream = ToolCallStream(plan, parser)
    content, _ = stream.feed(text, finished=True)
    if plan.mode in ("named", "required"):
        return None, stream.calls
    content = "".join(stream.content).strip() if stream.calls else "".join(stream.content)
    return (content or None) if stream.calls else content, stream.calls
