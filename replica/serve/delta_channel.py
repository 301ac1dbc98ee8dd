"""Batched deltas, replica side: one TCP connection per ingress replica carries the deltas of all
of that ingress's requests on this replica, one message per engine step.

Why: every item of a Ray Serve stream costs CPU in the replica and again in the ingress
(measured: ``docs/bench/cpu-speed.md``, "Random sampling and the served path's CPU per token"),
and a streamed request is one item per engine step. With 30 requests of one ingress on a
replica, that is 30 items per step; here it is one message of 30 deltas, pickled once and written
with one ``send``. vLLM's API server and engine core talk the same way (one ZeroMQ message per
step with every request's outputs).

Protocol (``router/dispatch/delta_receiver.py`` is the other end): the ingress opens a TCP connection to
the address the replica gave when it admitted the request, and sends its key (32 hex characters,
random per ingress replica) and a newline. From then on the replica writes frames: a 4-byte
big-endian length, then a pickled ``list[tuple[request_id, EngineOutput | Exception]]``. Nothing
else is read from the ingress; it closes the connection to end it. Only the ingress that holds
the key receives its requests' deltas, and a connection with an unknown key is closed at once.

A channel (one per key) holds the deltas put while no connection is attached and writes them
when one attaches, so the ingress may connect after its first request's first delta. A channel
that no request uses and no connection reads is dropped :data:`IDLE_DROP_S` seconds later. When
the ingress's connection ends (the ingress process died: it never closes one otherwise), the
requests of that channel still running here are aborted (``on_lost``), since their call no longer
yields anything through which Ray would notice that its caller is gone.
Everything runs on the replica's event loop; nothing here is thread-safe.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from replica.protocol.wire import KEY_BYTES, encode_frame

logger = logging.getLogger(__name__)



IDLE_DROP_S = 60.0
"""Seconds after which a channel that no request uses and no connection reads is dropped, with
whatever it still holds (its ingress did not connect, or its connection ended: it is gone)."""

HELLO_TIMEOUT_S = 10.0
"""Seconds a new connection has to send its key."""






class _Channel:
    """The deltas of one ingress's requests on this replica, and the connection they go out on."""

    __slots__ = ("key", "pending", "writer", "requests", "idle_timer", "_flush_due", "_loop")

    def __init__(self, key: str, loop: asyncio.AbstractEventLoop) -> None:
        self.key = key
        self.pending: list[tuple[str, Any]] = []
        self.writer: asyncio.StreamWriter | None = None
        self.requests: set[str] = set()  # requests of this channel running here
        self.idle_timer: asyncio.TimerHandle | None = None  # drops the channel when it fires
        self._flush_due = False
        self._loop = loop

    def put(self, request_id: str, item: Any) -> None:
        """Queue ``(request_id, item)``; everything queued within one turn of the event loop (one
        engine step's outputs arrive in one callback) goes out as one frame."""
        self.pending.append((request_id, item))
        if self.writer is not None and not self._flush_due:
            self._flush_due = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        """Write what is queued as one frame, if a connection is attached."""
        self._flush_due = False
        writer = self.writer
        if writer is None or not self.pending:
            return
        if writer.is_closing():
            self.writer = None
            return
        items, self.pending = self.pending, []
        writer.write(encode_frame(items))

    def attach(self, writer: asyncio.StreamWriter) -> None:
        """Send from now on through ``writer`` (closing a previous connection), starting with
        what is queued."""
        if self.writer is not None and self.writer is not writer:
            self.writer.close()
        self.writer = writer
        self.flush()


class DeltaChannels:
    """The replica's TCP server for batched deltas and its channels, one per ingress key.

    Args:
        host: the address to listen on and to give ingresses (the node's IP address, so that an
            ingress on another node can connect).
        on_lost: called with the ids of a channel's running requests when its connection ends.
    """

    def __init__(self, host: str, on_lost: Callable[[list[str]], None] | None = None) -> None:
        self.host = host
        self.on_lost = on_lost
        self.port: int | None = None
        self._server: asyncio.AbstractServer | None = None
        self._starting: asyncio.Lock | None = None
        self._channels: dict[str, _Channel] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    async def address(self) -> tuple[str, int]:
        """``(host, port)`` that ingresses connect to; starts the server on first use (port chosen
        by the OS), and again if the event loop changed (a replica used from several
        ``asyncio.run`` calls, as in tests). Raises ``OSError`` if it cannot listen."""
        loop = asyncio.get_running_loop()
        if self._server is not None and self._loop is not loop:
            self.close()
            self._server, self._starting, self._channels = None, None, {}
        self._loop = loop
        if self._server is None:
            if self._starting is None:
                self._starting = asyncio.Lock()
            async with self._starting:
                if self._server is None:
                    server = await asyncio.start_server(self._accept, self.host, 0)
                    self.port = server.sockets[0].getsockname()[1]
                    self._server = server
                    logger.info("batched deltas: listening on %s:%d", self.host, self.port)
        assert self.port is not None
        return self.host, self.port

    def acquire(self, key: str, request_id: str) -> _Channel:
        """The channel of ``key`` (created if new), with ``request_id`` among its running requests."""
        channel = self._channels.get(key)
        if channel is None:
            channel = self._channels[key] = _Channel(key, asyncio.get_running_loop())
        channel.requests.add(request_id)
        self._keep(channel)
        return channel

    def release(self, channel: _Channel, request_id: str) -> None:
        """``request_id`` of ``channel`` has ended. An unused channel without a connection is
        dropped :data:`IDLE_DROP_S` seconds later unless a request or a connection comes meanwhile."""
        channel.requests.discard(request_id)
        if not channel.requests and channel.writer is None:
            self._drop_later(channel)

    def _drop_later(self, channel: _Channel) -> None:
        self._keep(channel)
        channel.idle_timer = asyncio.get_running_loop().call_later(IDLE_DROP_S, self._drop_if_idle, channel)

    @staticmethod
    def _keep(channel: _Channel) -> None:
        if channel.idle_timer is not None:
            channel.idle_timer.cancel()
            channel.idle_timer = None

    def _drop_if_idle(self, channel: _Channel) -> None:
        if not channel.requests and channel.writer is None and self._channels.get(channel.key) is channel:
            del self._channels[channel.key]
            if channel.pending:
                logger.warning("batched deltas: dropped %d deltas no ingress came for", len(channel.pending))

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One ingress connection: read its key, attach it to that channel, and hold it until the
        ingress closes it. An unknown key or a malformed hello closes it at once."""
        channel = None
        try:
            line = await asyncio.wait_for(reader.readuntil(b"\n"), HELLO_TIMEOUT_S)
            key = line.strip().decode("ascii", errors="replace")
            channel = self._channels.get(key) if len(key) == KEY_BYTES else None
            if channel is None:
                return
            self._keep(channel)
            channel.attach(writer)
            await reader.read()  # returns at EOF: the ingress closed the connection
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, OSError):
            pass
        except asyncio.CancelledError:  # the loop is closing: asyncio's stream callback would log it
            pass
        finally:
            if channel is not None and channel.writer is writer:
                channel.writer = None
                if channel.requests and self.on_lost is not None:
                    logger.warning("batched deltas: an ingress connection ended; aborting its %d requests here", len(channel.requests))
                    self.on_lost(list(channel.requests))
                if not channel.requests:
                    self._drop_later(channel)
            writer.close()

    def close(self) -> None:
        """Stop listening and close every connection."""
        if self._server is not None:
            self._server.close()
        for channel in self._channels.values():
            if channel.writer is not None:
                channel.writer.close()
