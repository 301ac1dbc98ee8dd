"""Responses-API items and fields to the chat path's, and chat replies back to output items.

Input (:func:`chat_messages`): a string is one user message; a list holds items, each one of

* a message: ``{"type": "message"?, "role": "user" | "system" | "developer" | "assistant",
  "content": str | [{"type": "input_text" | "output_text", "text"}, ...]}``;
* ``{"type": "function_call", "call_id", "name", "arguments"}``: a call the model made, joined to
  the assistant message right before it as one of its ``tool_calls`` (as the chat path writes a
  reply with calls);
* ``{"type": "function_call_output", "call_id", "output"}``: the call's result, a ``tool`` message.

Anything else (images, files, ``reasoning``, ``item_reference``, built-in tool calls) is a 400
naming the item. Tools (:func:`chat_tools`), ``tool_choice`` and ``text.format``
(:func:`response_format`) become the chat request's ``tools``, ``tool_choice`` and
``response_format``; the chat path checks them further (:mod:`router.request.structured`).

Output (:func:`output_items`): a chat reply message becomes a ``message`` item (its text as one
``output_text`` part) unless it is calls only, then one ``function_call`` item per call.
"""

from __future__ import annotations

import uuid
from typing import Any

from router.request.protocol import OpenAIError

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
ITEM_TYPES = ("message", "function_call", "function_call_output")


def new_id(prefix: str) -> str:
    """``<prefix>_<48 hex digits>``, as OpenAI's ids (``resp_``, ``msg_``, ``fc_``)."""
    return f"{prefix}_{uuid.uuid4().hex}{uuid.uuid4().hex[:16]}"


def _refuse(param: str, message: str, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(f"{param}: {message}", param=param, code=code)


def _text(content: Any, param: str) -> str:
    """A message's text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _refuse(param, "must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise _refuse(f"{param}.{j}.type", f"content part type {kind!r} is not supported; supported: input_text, output_text",
                          "unsupported_value")
        if not isinstance(part.get("text"), str):
            raise _refuse(f"{param}.{j}.text", "must be a string")
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (key != "arguments" and not value):
        raise _refuse(f"{param}.{key}", "must be a non-empty string" if key != "arguments" else "must be a string (JSON)")
    return value


def chat_messages(input: str | list[dict[str, Any]], origins: list[str] | None = None) -> list[dict[str, Any]]:
    """The chat messages of a request's ``input`` (see the module's docstring); ``origins``, when
    given, gets each message's field (``input``, ``input.<i>``: the item that began it).

    Raises:
        OpenAIError: 400 naming ``input.<i>...``: an item type or content part not supported, a
            role not supported, a missing or mistyped field.
    """
    origins = [] if origins is None else origins
    if isinstance(input, str):
        origins.append("input")
        return [{"role": "user", "content": input}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(input):
        param = f"input.{i}"
        if not isinstance(item, dict):
            raise _refuse(param, "must be an object (an input item)")
        kind = item.get("type", "message" if "role" in item else None)
        count = len(messages)
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise _refuse(f"{param}.role", f"must be one of {', '.join(ROLES)}, got {role!r}")
            messages.append({"role": role, "content": _text(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", param), "type": "function",
                    "function": {"name": _string(item, "name", param), "arguments": _string(item, "arguments", param)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", param),
                             "content": _text(output, f"{param}.output")})
        else:
            raise _refuse(f"{param}.type", f"item type {kind!r} is not supported; supported: {', '.join(ITEM_TYPES)}",
                          "unsupported_value")
        origins += [param] * (len(messages) - count)
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' function tools (``{"type": "function", "name", "description", "parameters",
    "strict"}``) in the chat shape (``{"type": "function", "function": {...}}``).

    Raises:
        OpenAIError: 400 naming ``tools.<i>.type`` for a tool that is not a function (built-in
            tools: web search, file search, ...), or ``tools.<i>.name`` when it has none.
    """
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise _refuse(f"tools.{i}.type", f"tool type {tool.get('type')!r} is not supported; only 'function' tools are",
                          "unsupported_value")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        if not isinstance(function.get("name"), str):
            raise _refuse(f"tools.{i}.name", "a function tool needs a name")
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """``tool_choice`` in the chat shape: the strings as they are, ``{"type": "function", "name"}``
    as ``{"type": "function", "function": {"name"}}``.

    Raises:
        OpenAIError: 400 naming ``tool_choice`` for any other shape (built-in tools, allowed tools).
    """
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _refuse("tool_choice", "must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}")


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as the chat request's ``response_format``: ``text`` is none,
    ``json_object`` as is, ``json_schema`` (``name``, ``schema``, ``strict``, ``description`` at
    its top) with them under ``json_schema``.

    Raises:
        OpenAIError: 400 naming ``text.format`` for another type, or ``text.format.schema``
            when a ``json_schema`` format has no schema object.
    """
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise _refuse("text.format.schema", "a json_schema format needs a schema (a JSON object)")
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        schema.setdefault("name", "response")
        return {"type": "json_schema", "json_schema": schema}
    raise _refuse("text.format.type", f"must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def message_item(text: str, item_id: str | None = None, status: str = "completed") -> dict[str, Any]:
    """An assistant ``message`` output item holding ``text``."""
    return {
        "type": "message", "id": item_id or new_id("msg"), "status": status, "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def call_item(call: dict[str, Any], item_id: str | None = None, status: str = "completed") -> dict[str, Any]:
    """A ``function_call`` output item of a chat tool call (``{"id", "function": {"name", "arguments"}}``)."""
    return {
        "type": "function_call", "id": item_id or new_id("fc"), "call_id": call["id"],
        "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status,
    }


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """The output items of a chat reply ``message`` (``content``, ``tool_calls``)."""
    calls = message.get("tool_calls") or []
    items = [message_item(message.get("content") or "")] if message.get("content") or not calls else []
    return items + [call_item(call) for call in calls]
