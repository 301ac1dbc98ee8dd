"""Response formatting: replica outputs to OpenAI JSON bodies and server-sent events.

Owns: each choice's accumulated output (:class:`Choice`); the bodies of ``/v1/completions`` and
``/v1/chat/completions`` with usage and logprobs (:class:`ResponseFormatter`; the logprobs objects
come from :mod:`router.response.logprob_format`); their streamed events, ending with the usage chunk when
asked for and an error event when a replica fails; and the SSE framing (:func:`sse_frames`,
``data: [DONE]`` last) in a response that runs its cleanup however it ends (:class:`EventStream`).
"""

# No "from __future__ import annotations", as in router/ingress.py.

import json
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from replica.protocol.outputs import EngineOutput, TokenLogprobs
from router.request.errors import StreamError
from router.request.preparation import Prepared
from router.request.protocol import ChatCompletionRequest, CompletionRequest
from router.response.logprob_format import LogprobFormatter
from router.response.tool_calls import ToolCallStream, parse_reply


class Choice:
    """One choice's output, accumulated from its deltas (:meth:`add`).

    Attributes:
        index: the choice index (``prompt_index * n + j``).
        prompt_index: the prompt it continues.
        text: the text pieces, in order.
        token_ids, logprobs: the output tokens and their logprobs (when asked for).
        prompt_logprobs: one entry per prompt token (None for the first), when asked for.
        finish_reason, stop_reason: set by the last delta.
        num_output_tokens: output tokens so far.
        num_cached_tokens: prompt tokens the replica found in its prefix cache.
    """

    __slots__ = (
        "index", "prompt_index", "text", "token_ids", "logprobs", "prompt_logprobs", "finish_reason", "stop_reason",
        "num_output_tokens", "num_cached_tokens",
    )

    def __init__(self, index: int, prompt_index: int) -> None:
        self.index = index
        self.prompt_index = prompt_index
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] = []
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_output_tokens = 0
        self.num_cached_tokens = 0

    def add(self, delta: EngineOutput) -> None:
        """Append a delta (or a whole output) of this choice."""
        self.text.append(delta.new_text)
        self.token_ids.extend(delta.new_token_ids)
        if delta.new_logprobs:
            self.logprobs.extend(delta.new_logprobs)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.num_output_tokens = delta.num_output_tokens
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.finished:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason


def _stream_event(prepared: Prepared, kind: str, choices: list[dict[str, Any]], usage: dict[str, int] | None) -> dict[str, Any]:
    """One SSE event of a streamed response (``kind``: ``text_completion`` or ``chat.completion.chunk``)."""
    event = {"id": prepared.request_id, "object": kind, "created": prepared.created, "model": prepared.model, "choices": choices}
    if usage is not None:
        event["usage"] = usage
    return event


def _response_body(prepared: Prepared, kind: str, choices: list[dict[str, Any]], usage: dict[str, int]) -> dict[str, Any]:
    """A whole (not streamed) response body (``kind``: ``text_completion`` or ``chat.completion``)."""
    return {
        "id": prepared.request_id,
        "object": kind,
        "created": prepared.created,
        "model": prepared.model,
        "choices": choices,
        "usage": usage,
    }


def _collect(prepared: Prepared, outputs: list[EngineOutput]) -> list[Choice]:
    """The choices of a non-streamed request from its outputs (in the order of ``prepared.jobs()``)."""
    choices = []
    for (index, p, _, _), output in zip(prepared.jobs(), outputs):
        choice = Choice(index, p)
        choice.add(output)
        choices.append(choice)
    return choices


class ResponseFormatter:
    """Builds the OpenAI bodies and events of one model's responses.

    Args:
        tokenizer: the model's tokenizer (logprobs: :class:`router.response.logprob_format.LogprobFormatter`).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.logprobs = LogprobFormatter(tokenizer)

    def _usage(self, prepared: Prepared, choices: Iterable[Choice]) -> dict[str, Any]:
        """OpenAI's usage: prompt tokens once per prompt, completion tokens of every choice, and
        ``prompt_tokens_details.cached_tokens``, the prefix-cache hits of each prompt's first choice."""
        choices = list(choices)
        completion = sum(c.num_output_tokens for c in choices)
        cached = {}
        for c in sorted(choices, key=lambda c: c.index):
            cached.setdefault(c.prompt_index, c.num_cached_tokens)
        return {
            "prompt_tokens": prepared.num_prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prepared.num_prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": sum(cached.values())},
        }

    # ---- whole bodies --------------------------------------------------------------------------
    def completion_body(self, prepared: Prepared, body: CompletionRequest, outputs: list[EngineOutput]) -> dict[str, Any]:
        """The ``text_completion`` body of ``outputs`` (one per job of ``prepared``, in order)."""
        choices = _collect(prepared, outputs)
        out = []
        for c in choices:
            prefix = prepared.prompt_texts[c.prompt_index] if body.echo else ""
            text = "".join(c.text)
            logprobs = None
            if body.logprobs is not None:
                scored = (prepared.prompts[c.prompt_index], c.prompt_logprobs, body.logprobs) if body.echo else ()
                logprobs = self.logprobs.completion(c.logprobs, len(prefix), *scored)
            out.append(
                {
                    "index": c.index,
                    "text": prefix + text,
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                    "prompt_logprobs": self.logprobs.prompt(c.prompt_logprobs, body.prompt_logprobs),
                }
            )
        return _response_body(prepared, "text_completion", out, self._usage(prepared, choices))

    def chat_body(self, prepared: Prepared, body: ChatCompletionRequest, outputs: list[EngineOutput]) -> dict[str, Any]:
        """The ``chat.completion`` body of ``outputs`` (one per job of ``prepared``, in order)."""
        choices = _collect(prepared, outputs)
        plan = prepared.tool_plan if prepared.tool_plan is not None and prepared.tool_plan.mode != "none" else None
        out = []
        for c in choices:
            message: dict[str, Any] = {"role": prepared.reply_role, "content": "".join(c.text)}
            finish_reason = c.finish_reason
            if plan is not None:
                message["content"], calls = parse_reply(message["content"], plan, prepared.tool_parser)
                if calls:
                    message["tool_calls"] = calls
                    finish_reason = _tool_finish(plan.mode, finish_reason)
            if prepared.echo_text:  # vLLM's echo: the prefilled turn, then the reply
                message["content"] = prepared.echo_text + (message["content"] or "")
            out.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": {"content": self.logprobs.chat(c.logprobs)} if body.logprobs else None,
                    "finish_reason": finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        response = _response_body(prepared, "chat.completion", out, self._usage(prepared, choices))
        response["prompt_logprobs"] = self.logprobs.prompt(choices[0].prompt_logprobs, body.prompt_logprobs)  # vLLM's place
        return response

    # ---- streamed events -------------------------------------------------------------------------
    def completion_events(
        self,
        prepared: Prepared,
        body: CompletionRequest,
        deltas: AsyncIterator[tuple[int, EngineOutput]],
        on_close: Callable[[], None],
    ) -> AsyncIterator[dict[str, Any]]:
        """The ``text_completion`` events of ``deltas`` (``(choice index, delta)``, raising
        :class:`~router.request.errors.StreamError` on a replica failure, which becomes the last event):
        first the prompts with ``echo`` (with ``logprobs`` too: in each choice's first event, which
        carries the prompt's logprobs), then the text of each delta; ``prompt_logprobs`` come with
        a choice's first delta. ``on_close`` runs however the events end (it cancels the replica
        requests)."""
        jobs = prepared.jobs()
        prompt_of = {index: p for index, p, _, _ in jobs}
        offsets = {index: len(prepared.prompt_texts[p]) if body.echo else 0 for index, p, _, _ in jobs}
        echo_scored = body.echo and body.logprobs is not None
        unechoed = set(prompt_of) if echo_scored else set()  # choices whose prompt is still to echo
        opening = []
        if body.echo and not echo_scored:
            opening.append([
                {"index": index, "text": prepared.prompt_texts[p], "logprobs": None, "finish_reason": None}
                for index, p, _, _ in jobs
            ])

        def entry(index: int, delta: EngineOutput) -> dict[str, Any] | None:
            first = index in unechoed or delta.prompt_logprobs is not None
            if not (first or delta.new_text or delta.finished or (body.logprobs is not None and delta.new_logprobs)):
                return None
            prefix, scored = "", ()
            if index in unechoed:
                unechoed.discard(index)
                p = prompt_of[index]
                prefix, scored = prepared.prompt_texts[p], (prepared.prompts[p], delta.prompt_logprobs, body.logprobs)
            logprobs = None
            if body.logprobs is not None:
                logprobs = self.logprobs.completion(delta.new_logprobs or [], offsets[index], *scored)
                if logprobs["tokens"]:
                    offsets[index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
            item = {
                "index": index,
                "text": prefix + delta.new_text,
                "logprobs": logprobs,
                "finish_reason": delta.finish_reason if delta.finished else None,
                "stop_reason": delta.stop_reason if delta.finished else None,
            }
            if body.prompt_logprobs is not None and delta.prompt_logprobs is not None:
                item["prompt_logprobs"] = self.logprobs.prompt(delta.prompt_logprobs, body.prompt_logprobs)
            return item

        return self._events(prepared, "text_completion", body, opening, deltas, entry, on_close)

    def chat_events(
        self,
        prepared: Prepared,
        body: ChatCompletionRequest,
        deltas: AsyncIterator[tuple[int, EngineOutput]],
        on_close: Callable[[], None],
    ) -> AsyncIterator[dict[str, Any]]:
        """The ``chat.completion.chunk`` events of ``deltas``: first each choice's role, then its
        echoed text (``echo``, :mod:`router.request.chat_flags`), then as :meth:`completion_events`."""
        opening = [
            [{"index": index, "delta": {"role": prepared.reply_role, "content": ""}, "logprobs": None, "finish_reason": None}]
            for index, _, _, _ in prepared.jobs()
        ]
        if prepared.echo_text:
            opening += [
                [{"index": index, "delta": {"content": prepared.echo_text}, "logprobs": None, "finish_reason": None}]
                for index, _, _, _ in prepared.jobs()
            ]

        plan = prepared.tool_plan if prepared.tool_plan is not None and prepared.tool_plan.mode != "none" else None
        tool_streams = {index: ToolCallStream(plan, prepared.tool_parser) for index, _, _, _ in prepared.jobs()} if plan else {}

        def entry(index: int, delta: EngineOutput) -> dict[str, Any] | None:
            prompt_logprobs = None
            if body.prompt_logprobs is not None and delta.prompt_logprobs is not None:
                prompt_logprobs = self.logprobs.prompt(delta.prompt_logprobs, body.prompt_logprobs)
            text, calls, finish_reason = delta.new_text, [], delta.finish_reason
            if plan is not None:
                text, calls = tool_streams[index].feed(delta.new_text, delta.finished)
                if tool_streams[index].calls:
                    finish_reason = _tool_finish(plan.mode, finish_reason)
            if not text and not calls and not delta.finished and not (body.logprobs and delta.new_logprobs) and prompt_logprobs is None:
                return None
            message = {"content": text} if text or (not delta.finished and not calls) else {}
            if calls:
                message["tool_calls"] = calls
            item = {
                "index": index,
                "delta": message,
                "logprobs": {"content": self.logprobs.chat(delta.new_logprobs or [])} if body.logprobs else None,
                "finish_reason": finish_reason if delta.finished else None,
                "stop_reason": delta.stop_reason if delta.finished else None,
            }
            if prompt_logprobs is not None:
                item["prompt_logprobs"] = prompt_logprobs
            return item

        return self._events(prepared, "chat.completion.chunk", body, opening, deltas, entry, on_close)

    async def _events(
        self,
        prepared: Prepared,
        kind: str,
        body: CompletionRequest | ChatCompletionRequest,
        opening: list[list[dict[str, Any]]],
        deltas: AsyncIterator[tuple[int, EngineOutput]],
        entry: Callable[[int, EngineOutput], dict[str, Any] | None],
        on_close: Callable[[], None],
    ) -> AsyncIterator[dict[str, Any]]:
        """The events of a streamed response: one per ``opening`` list of choice entries, one per
        delta that ``entry`` turns into a choice entry (None: nothing to send), the usage when
        ``stream_options.include_usage``; an error event instead of the rest on a
        :class:`~router.request.errors.StreamError`. ``on_close`` runs however it ends."""

        def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> dict[str, Any]:
            return _stream_event(prepared, kind, choices, usage)

        choices = {index: Choice(index, p) for index, p, _, _ in prepared.jobs()}
        try:
            for entries in opening:
                yield chunk(entries)
            async for index, delta in deltas:
                choices[index].add(delta)
                item = entry(index, delta)
                if item is not None:
                    yield chunk([item])
            if body.stream_options and body.stream_options.include_usage:
                yield chunk([], self._usage(prepared, choices.values()))
        except StreamError as exc:
            yield exc.error.body()
        finally:  # closed early (client gone): no replica request outlives the response
            on_close()


def _tool_finish(mode: str, finish_reason: str | None) -> str | None:
    """A reply that calls tools ends with ``tool_calls`` (OpenAI's reason) where the model chose
    to call (``auto``, ``required``); a named function's reply keeps ``stop``, as OpenAI's does."""
    return "tool_calls" if finish_reason == "stop" and mode != "named" else finish_reason


# JSON leaves these raw inside strings, and Python's str.splitlines() (and clients that split a
# stream on Unicode line breaks) would cut a frame there; escaped, they mean the same characters.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


async def sse_frames(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """Server-sent-event frames: ``data: <json>`` per event, then ``data: [DONE]``. Each frame is
    one line under any line splitting: the Unicode line breaks JSON leaves raw (U+0085, U+2028,
    U+2029) are written as ``\\u`` escapes."""
    async for event in events:
        yield f"data: {json.dumps(event, ensure_ascii=False).translate(_LINE_BREAKS)}\n\n"
    yield "data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """A server-sent-events response that runs ``on_close`` however it ends: finished, failed, or
    cancelled because the client went away, even before its first frame (then the frames'
    generator never starts, so its own cleanup cannot run, and the replica requests it would
    have read must still be cancelled)."""

    def __init__(self, content: AsyncIterator[str], on_close: Any) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
