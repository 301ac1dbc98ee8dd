"""Where a request's outputs go on the caller's side of :class:`~replica.engine.async_engine.AsyncLLMEngine`:
its :class:`Stream` (an ``asyncio.Queue`` on the caller's event loop, or a :class:`Sink` that hands
each delta to a callback), and :func:`put_all`, which the loop thread schedules on that event loop
to deliver a step's items in one wake-up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from replica.core.request import Request
from replica.protocol.outputs import EngineOutput


@dataclass
class Stream:
    """Where a request's outputs go. ``added`` turns true when the loop thread has added
    ``request`` to the engine: until then an output under the same id belongs to an earlier
    request whose caller left (its abort still queued) and is not delivered here."""

    loop: asyncio.AbstractEventLoop
    queue: Any  # asyncio.Queue, or a Sink: what has put_nowait(item)
    request: Request | None = None
    added: bool = False


class Sink:
    """A stream's receiver for :meth:`AsyncLLMEngine.run <replica.engine.async_engine.AsyncLLMEngine.run>`: each delta goes to ``on_output`` at
    once; the last one (``finished``) or an error resolves ``done``. Items after that (none are
    expected) are ignored."""

    __slots__ = ("on_output", "done")

    def __init__(self, on_output: Callable[[EngineOutput], None], done: asyncio.Future) -> None:
        self.on_output = on_output
        self.done = done

    def put_nowait(self, item: EngineOutput | BaseException) -> None:
        if self.done.done():
            return
        if isinstance(item, BaseException):
            self.done.set_exception(item)
            return
        try:
            self.on_output(item)
        except Exception as exc:  # the consumer failed: end this request
            self.done.set_exception(exc)
            return
        if item.finished:
            self.done.set_result(None)


def put_all(items: list[tuple[asyncio.Queue, EngineOutput | BaseException]]) -> None:
    for q, item in items:
        q.put_nowait(item)
