"""The ingress's server-sent-events response cancels its replica requests however it ends."""

from __future__ import annotations

import asyncio

import pytest

from router.response.responses import EventStream as _EventStream


def _respond(response, send) -> None:
    async def receive():
        await asyncio.sleep(3600)  # the client never sends anything more

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "method": "POST", "path": "/"}
    asyncio.run(asyncio.wait_for(response(scope, receive, send), timeout=10))


def test_closed_after_the_last_frame():
    closed, sent = [], []

    async def frames():
        yield "data: 1\n\n"
        yield "data: [DONE]\n\n"

    async def send(message):
        sent.append(message)

    _respond(_EventStream(frames(), on_close=lambda: closed.append(True)), send)
    assert [m.get("body") for m in sent if m["type"] == "http.response.body"][:2] == [b"data: 1\n\n", b"data: [DONE]\n\n"]
    assert closed == [True]


def test_closed_when_the_client_is_gone_before_the_first_frame():
    """The frames' generator never starts (so its own ``finally`` cannot run); the replica
    requests must be cancelled all the same."""
    closed, started = [], []

    async def frames():
        started.append(True)
        yield "data: 1\n\n"

    async def send(message):
        raise OSError("client gone")

    with pytest.raises(Exception):
        _respond(_EventStream(frames(), on_close=lambda: closed.append(True)), send)
    assert started == [] and closed == [True]


def test_a_frame_stays_one_line_whatever_its_text_holds():
    """A streamed echo of the prompt '\\x85' broke the frame for any client that splits lines the
    way str.splitlines() does (found by the e2e fuzzer): JSON leaves U+0085, U+2028 and U+2029
    raw. They are escaped, and the frame decodes to the same text."""
    from router.response.responses import sse_frames

    text = "a\x85b\u2028c\u2029d\ne\r\x0bf\x1cg\x1dh\x1ei é 漢"

    async def events():
        yield {"choices": [{"text": text}]}

    async def collect():
        return [frame async for frame in sse_frames(events())]

    import json

    frames = asyncio.run(collect())
    assert frames[-1] == "data: [DONE]\n\n"
    lines = [line for line in "".join(frames).splitlines() if line]
    assert [line.startswith("data: ") for line in lines] == [True, True]
    assert json.loads(lines[0][len("data: "):])["choices"][0]["text"] == text
    assert "é 漢" in lines[0]  # other text stays unescaped
