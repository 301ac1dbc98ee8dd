"""The Responses API over the chat path: a request becomes a chat request, its reply a response
object or typed events, and the response is stored for ``GET`` and follow-ups.

A turn (:meth:`ResponsesAPI.begin`): the stored conversation of ``previous_response_id`` (its
chat messages: every earlier turn's input and reply, without instructions), then this request's
``input`` (:mod:`router.responses.items`), behind this request's ``instructions`` as a system
message (OpenAI's rule: instructions are not carried over). That chat runs as a
``/v1/chat/completions`` request would (the ingress's checks, :class:`RequestPreparer`, fan-out,
:class:`ResponseFormatter`), so a follow-up's prompt is the whole conversation through the chat
template, and the prefix-aware router sends it to the replica holding its blocks.

Stored (``store``, the default): one record per response, JSON bytes ``{"response": <the
response object>, "messages": <the conversation with this reply>}`` under its id, in the
:class:`~router.responses.store.ResponseStore`. A record holds its whole conversation, so a
follow-up reads one record, and deleting or evicting one response leaves the others whole.
A conversation already larger than ``response_store_max_bytes`` before generation is a 400
``response_too_large``; a record that the reply makes too large (or a store that fails) is not
kept, and the response says ``"store": false``.

Errors of the chat path name the chat fields; :func:`responses_error` renames them
(``messages`` → ``input``, ``response_format`` → ``text.format``, ``max_completion_tokens`` →
``max_output_tokens``, ``tools.<i>.function.<field>`` → ``tools.<i>.<field>``).
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError

from router.request.errors import validation_error
from router.request.protocol import ChatCompletionRequest, OpenAIError
from router.responses.events import EventBuilder
from router.responses.items import (
    chat_messages, chat_tool_choice, chat_tools, new_id, output_items, response_format,
)
from router.responses.protocol import ResponsesRequest, check_supported
from router.responses.store import RecordTooLarge, ResponseStore

logger = logging.getLogger(__name__)

_RENAMES = (
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
    ("messages", "input"),
)


def responses_error(exc: OpenAIError, origins: list[str] = ()) -> OpenAIError:
    """``exc`` with the chat path's field names as the Responses API's (``param``, the
    message's leading ``<param>:``, and ``max_completion_tokens`` anywhere in it). ``origins``: each chat message's field
    (:attr:`Turn.origins`): ``messages.<i>...`` becomes the field its message came from."""
    index = re.match(r"messages\.(\d+)", exc.param or "")
    if index and int(index.group(1)) < len(origins):
        origin = origins[int(index.group(1))]
        rest = exc.param[index.end():] if origin.startswith("input.") else ""
        _rename(exc, index.group(0), origin, rest)
        return exc
    tool = re.match(r"tools\.\d+\.function(?=\.|$)", exc.param or "")
    if tool:  # a Responses tool has its name and parameters at its top, not under "function"
        _rename(exc, tool.group(0), tool.group(0)[: -len(".function")], exc.param[tool.end():])
        return exc
    for old, new in _RENAMES:
        if exc.param is not None and (exc.param == old or exc.param.startswith(old + ".")):
            _rename(exc, old, new, exc.param[len(old):])
            break
    if "max_completion_tokens" in exc.message:  # "... Please reduce the prompt or max_completion_tokens."
        exc.message = exc.message.replace("max_completion_tokens", "max_output_tokens")
        exc.args = (exc.message,)
    return exc


def _rename(exc: OpenAIError, old: str, new: str, rest: str) -> None:
    """``exc.param`` (``old`` + more) as ``new + rest``, in the message's lead too."""
    if exc.message.startswith(exc.param):
        exc.message = new + rest + exc.message[len(exc.param):]
    exc.param = new + rest
    exc.args = (exc.message,)


async def _stored(call) -> Any:
    """``await call`` on the response store; a store that fails (its replica restarting, an
    external store down) is a 503 the client may retry, not a 500."""
    try:
        return await call
    except Exception as exc:
        logger.warning("the response store failed: %r", exc)
        raise OpenAIError(f"the response store is unavailable ({type(exc).__name__}); retry", 503,
                          type="service_unavailable_error") from None


def not_found(response_id: str) -> OpenAIError:
    return OpenAIError(f"Response with id '{response_id}' not found.", 404, code="not_found")


class Turn:
    """One request's turn of a conversation.

    Attributes:
        id: the response id, ``resp_<hex>``.
        body: the request.
        chat: the chat request it runs as.
        conversation: the chat messages a follow-up continues from, before this reply (no instructions).
        store: whether the response is to be stored (the request's ``store`` and a store exists).
        created_at: Unix time, seconds.
        model: the model id the response names.
        origins: each chat message's field (``instructions``, ``previous_response_id``, ``input``,
            ``input.<i>``), so that the chat path's errors name it (:func:`responses_error`).
    """

    def __init__(self, body: ResponsesRequest, chat: ChatCompletionRequest, conversation: list[dict[str, Any]], store: bool, model: str):
        self.id = new_id("resp")
        self.body = body
        self.chat = chat
        self.conversation = conversation
        self.store = store
        self.created_at = int(time.time())
        self.model = model
        self.origins: list[str] = []


def _usage(chat_usage: dict[str, int] | None) -> dict[str, Any] | None:
    """The chat usage as the Responses API's (``cached_tokens``: the prompt tokens the replica
    found in its prefix cache)."""
    if chat_usage is None:
        return None
    return {
        "input_tokens": chat_usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": chat_usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)},
        "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


class ResponsesAPI:
    """The endpoints' work, apart from running the chat request (the ingress's).

    Args:
        store: where responses are kept (:func:`router.responses.store.open_store`); None: none
            are (``response_store: none``; ``store`` is then false in every response and a
            ``previous_response_id`` is a 400).
        model_name: the served model's id (a request without ``model``).
        max_bytes: ``response_store_max_bytes``: a conversation past it before generation is refused.
    """

    def __init__(self, store: ResponseStore | None, model_name: str, max_bytes: int) -> None:
        self.store = store
        self.model_name = model_name
        self.max_bytes = max_bytes

    # ---- a new response --------------------------------------------------------------------------
    async def begin(self, body: ResponsesRequest) -> Turn:
        """The request as a chat request, with the conversation it continues.

        Raises:
            OpenAIError: 400 for what :func:`~router.responses.protocol.check_supported` refuses,
                an input item or field :mod:`router.responses.items` refuses, a conversation
                larger than the store's bound (``response_too_large``), or a chat body that does
                not validate; 400 ``previous_response_not_found`` (OpenAI's status and code) for a ``previous_response_id``
                not stored (never, deleted, expired or evicted).
        """
        check_supported(body)
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            history = (await self._previous(body.previous_response_id))["messages"]
        origins: list[str] = []
        conversation = history + chat_messages(body.input, origins)
        store = body.store and self.store is not None
        if store:
            size = len(json.dumps(conversation).encode())
            if size > self.max_bytes:
                raise OpenAIError(
                    f"input: the conversation ({size} bytes) is larger than the response store holds "
                    f"({self.max_bytes} bytes); send store: false, or a shorter conversation",
                    param="input", code="response_too_large",
                )
        system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
        messages = system + conversation
        origins = ["instructions"] * len(system) + ["previous_response_id"] * len(history) + origins
        fields: dict[str, Any] = {
            "model": body.model, "messages": messages, "max_completion_tokens": body.max_output_tokens,
            "tools": chat_tools(body.tools), "tool_choice": chat_tool_choice(body.tool_choice),
            "parallel_tool_calls": body.parallel_tool_calls, "response_format": response_format(body.text),
            "stream": body.stream, "stream_options": {"include_usage": True} if body.stream else None, "user": body.user,
        }
        for name in ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty"):
            fields[name] = getattr(body, name)
        try:
            chat = ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
        except ValidationError as exc:
            raise responses_error(validation_error(exc.errors()), origins) from None
        turn = Turn(body, chat, conversation, store, body.model or self.model_name)
        turn.origins = origins
        return turn

    async def _previous(self, response_id: str) -> dict[str, Any]:
        if self.store is None:
            raise OpenAIError(
                "previous_response_id: this server stores no responses (response_store: none)",
                param="previous_response_id", code="unsupported_parameter",
            )
        record = await _stored(self.store.get(response_id))
        if record is None:
            raise OpenAIError(
                f"Previous response with id '{response_id}' not found.", 400,
                param="previous_response_id", code="previous_response_not_found",
            )
        return json.loads(record)

    def response_object(self, turn: Turn, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                        error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The ``response`` object of ``turn`` (OpenAI's fields)."""
        body = turn.body
        fmt = (body.text or {}).get("format") or {"type": "text"}
        return {
            "id": turn.id, "object": "response", "created_at": turn.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "background": False, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": turn.model,
            "output": output, "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": turn.store, "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": fmt}, "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": body.tools or [], "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": "disabled",
            "usage": usage, "user": body.user, "metadata": body.metadata or {},
        }

    async def finish(self, turn: Turn, chat_body: dict[str, Any]) -> dict[str, Any]:
        """The response of a whole chat body (``chat.completion``), stored when asked."""
        choice = chat_body["choices"][0]
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        output = output_items(choice["message"])
        if status == "incomplete":
            for item in output:
                item["status"] = "incomplete"
        response = self.response_object(turn, status, output, _usage(chat_body["usage"]))
        message = {k: v for k, v in choice["message"].items() if k in ("role", "content", "tool_calls")}
        await self._save(turn, response, message)
        return response

    async def events(self, turn: Turn, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        """The typed events of a streamed response (:mod:`router.responses.events`) from the chat
        path's chunks; stored, when asked, before the last event. A replica's failure (an error
        chunk) ends it with ``response.failed``."""
        builder = EventBuilder(self.response_object(turn, "in_progress", []))
        for event in builder.opening():
            yield event
        async for chunk in chunks:
            if "error" in chunk:
                error = chunk["error"]
                failed = self.response_object(turn, "failed", builder.output, None, {"code": error["code"], "message": error["message"]})
                failed["store"] = False
                yield builder.event("response.failed", response=failed)
                return
            for event in builder.chunk(chunk):
                yield event
        for event in builder.closing():
            yield event
        status = "incomplete" if builder.finish_reason == "length" else "completed"
        response = self.response_object(turn, status, builder.output, _usage(builder.usage))
        await self._save(turn, response, builder.assistant_message())
        yield builder.event("response.completed" if status == "completed" else "response.incomplete", response=response)

    async def _save(self, turn: Turn, response: dict[str, Any], message: dict[str, Any]) -> None:
        """Store the response and its conversation; on a record too large or a store that fails,
        keep nothing and set ``response["store"]`` false (logged)."""
        if not turn.store:
            return
        record = json.dumps({"response": response, "messages": turn.conversation + [message]}).encode()
        try:
            await self.store.put(turn.id, record)
        except RecordTooLarge as exc:
            logger.warning("response %s is not stored: %s", turn.id, exc)
            response["store"] = False
        except Exception as exc:  # the store's replica is gone, or an external store failed
            logger.warning("response %s is not stored: the store failed: %r", turn.id, exc)
            response["store"] = False

    # ---- stored responses -------------------------------------------------------------------------
    async def retrieve(self, response_id: str, stream: str | None = None) -> dict[str, Any]:
        """``GET /v1/responses/{id}``: the stored response.

        Args:
            stream: the ``stream`` query parameter as sent (None: absent).

        Raises:
            OpenAIError: 400 ``unsupported_parameter`` for ``stream`` other than false (OpenAI
                replays a response's events; this server does not, and its JSON would read as an
                empty stream); 404 when the response is not stored; 503 when the store fails.
        """
        if stream is not None and stream.lower() not in ("false", "0"):
            raise OpenAIError(
                "stream: a stored response is not replayed as events; GET it without stream",
                param="stream", code="unsupported_parameter",
            )
        record = await _stored(self.store.get(response_id)) if self.store is not None else None
        if record is None:
            raise not_found(response_id)
        return json.loads(record)["response"]

    async def delete(self, response_id: str) -> dict[str, Any]:
        """``DELETE /v1/responses/{id}``: forget it. Raises 404 when not stored, 503 when the store fails."""
        if self.store is None or not await _stored(self.store.delete(response_id)):
            raise not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}
