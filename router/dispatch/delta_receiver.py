"""Batched deltas, ingress side: one TCP connection per replica receives the deltas of all of this
ingress's streamed requests there, one frame per engine step (``replica/serve/delta_channel.py`` is the
other end and describes the protocol).

:class:`DeltaReceiver` keeps an ``asyncio.Queue`` per request, registered before the request is
sent (:meth:`DeltaReceiver.open`), and one connection per replica address, opened when a replica
first admits one of this ingress's requests (:meth:`DeltaReceiver.connect`). A reader task per
connection puts each delta on its request's queue; deltas of requests no longer registered (the
client went away) are dropped. When a connection ends, every request bound to it gets
:class:`ConnectionLost` on its queue.

Runs on the ingress's event loop; nothing here is thread-safe.
"""

# No "from __future__ import annotations", as in router/ingress.py.

import asyncio
import logging
import pickle
import secrets
from collections.abc import AsyncIterator
from typing import Any, Optional

from replica.protocol.outputs import EngineOutput, merge_queued
from replica.protocol.wire import HEADER, KEY_BYTES

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
"""Seconds to open a connection to a replica."""

LAST_DELTA_GRACE_S = 5.0
"""Seconds a request whose replica call has ended normally waits for its last delta (written to
the connection before the call ended) before it ends with :class:`ConnectionLost`."""

CALL_END_GRACE_S = 2.0
"""Seconds a request whose connection ended waits for its replica call to report the replica's
death (then it may start again elsewhere) before it ends with :class:`ConnectionLost` (the caller
then cancels the call, which aborts the request on the replica); and seconds a request whose call
failed waits for its connection to end (deltas the replica wrote before it died may still be on
their way) before it ends with the call's error."""


class ConnectionLost(ConnectionError):
    """A request's deltas were lost: its replica's connection ended before its last delta, or
    ended before the request was bound to it. Nothing of it may have reached the client yet, so
    the ingress may start it again (``router.dispatch.choice_stream.replica_gone``)."""


class ReplicaUnreachable(ConnectionError):
    """The replica's batched-delta address could not be connected to (the replica is gone, or the
    network refuses the port); the ingress starts the request again through a Ray stream."""


class CallEnded:
    """Put on a batched-delta queue when the choice's replica call ended: ``error`` is None when it
    ended normally (the request's deltas came or come through the connection), else what it
    raised (e.g. the replica died)."""

    __slots__ = ("error",)

    def __init__(self, error: Optional[BaseException]) -> None:
        self.error = error


def on_call_end(queue: asyncio.Queue, watch: asyncio.Future) -> None:
    """Done-callback of the task that awaits the end of a request's replica call (after its
    admission): puts :class:`CallEnded` on the request's queue."""
    if watch.cancelled():
        return
    error = watch.exception()
    queue.put_nowait(CallEnded(None if error is None or isinstance(error, StopAsyncIteration) else error))


async def queued_deltas(queue: asyncio.Queue, watch: Optional[asyncio.Future]) -> AsyncIterator[EngineOutput]:
    """The deltas of an admitted request from its queue, until the finished one; deltas that
    piled up come out merged into one. ``watch`` is the task awaiting the end of its replica
    call (:func:`on_call_end`).

    A call that fails (the replica died) may overtake deltas the replica had already written:
    the error travels through Ray, the deltas through TCP. So its error is raised only when the
    connection has ended too (a dead replica's socket is closed by its kernel), or
    :data:`CALL_END_GRACE_S` seconds later. Deltas that come meanwhile are held back: a request
    whose finished delta comes completes (all of them as one delta); otherwise none is yielded,
    so that a request of which nothing was sent yet may still start again elsewhere.

    Raises the error that ended the request (sent by the replica, or raised by its call, e.g.
    the replica died), or :class:`ConnectionLost` when its connection ended first, or when its
    last delta has not come :data:`LAST_DELTA_GRACE_S` seconds after its call ended."""
    held = None
    call_ended = False
    failed: Optional[BaseException] = None  # the call's error, raised once the connection ends
    pending: Optional[EngineOutput] = None  # deltas that came after ``failed``, held back
    give_up_at = 0.0  # loop time at which ``failed`` is raised if the connection has not ended
    while True:
        if held is not None:
            item, held = held, None
        elif failed is not None or call_ended:  # the last delta was written before the call ended
            if failed is not None:  # one deadline, however many deltas come meanwhile
                timeout = max(0.0, give_up_at - asyncio.get_running_loop().time())
            else:
                timeout = LAST_DELTA_GRACE_S
            try:
                item = await asyncio.wait_for(queue.get(), timeout)
            except asyncio.TimeoutError:
                if failed is not None:
                    raise failed from None
                raise ConnectionLost("the replica's last delta for this request did not arrive") from None
        else:
            item = await queue.get()
        if isinstance(item, CallEnded):
            if item.error is not None:
                failed = item.error
                give_up_at = asyncio.get_running_loop().time() + CALL_END_GRACE_S
            else:
                call_ended = True
            continue
        if isinstance(item, ConnectionLost):
            if failed is not None:
                raise failed
            if watch is not None:
                try:  # a dead replica makes its call fail too: that error allows a retry elsewhere
                    await asyncio.wait_for(asyncio.shield(watch), CALL_END_GRACE_S)
                except (StopAsyncIteration, asyncio.TimeoutError):
                    pass
            raise item
        if isinstance(item, BaseException):
            raise item
        if failed is not None:
            pending = item if pending is None else pending.merged(item)
            if pending.finished:
                yield pending
                return
            continue
        item, held = merge_queued(item, queue)
        yield item
        if item.finished:
            return


class _Connection:
    """One replica's connection: its reader task and the requests bound to it."""

    __slots__ = ("address", "ready", "requests", "task")

    def __init__(self, address: tuple[str, int]) -> None:
        self.address = address
        self.ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self.requests: set[str] = set()
        self.task: Optional[asyncio.Task] = None


class DeltaReceiver:
    """The ingress's end of batched deltas.

    Attributes:
        key: this ingress's key (``KEY_BYTES`` random hex characters); replicas send the deltas of
            requests that carry it to the connection that presents it.
    """

    def __init__(self) -> None:
        self.key = secrets.token_hex(KEY_BYTES // 2)
        self._queues: dict[str, asyncio.Queue] = {}
        self._connections: dict[tuple[str, int], _Connection] = {}
        # Connections that ended so far, and per address the count when its last one ended: a
        # request opened before that may have had deltas on the connection that ended.
        self._ended = 0
        self._last_end: dict[tuple[str, int], int] = {}
        self._opened_at: dict[str, int] = {}

    def open(self, request_id: str) -> asyncio.Queue:
        """Register ``request_id`` (before sending it) and return the queue its deltas arrive on.

        Raises ``ValueError`` if it is registered already."""
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already registered")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._opened_at[request_id] = self._ended
        return queue

    def close(self, request_id: str) -> None:
        """Forget ``request_id``: its later deltas are dropped. A no-op if unknown."""
        self._queues.pop(request_id, None)
        self._opened_at.pop(request_id, None)
        for connection in self._connections.values():
            connection.requests.discard(request_id)

    async def connect(self, address: Any, request_id: str) -> None:
        """Make sure a connection to the replica at ``address`` (``(host, port)``, as its admission
        gave it) is open, and bind ``request_id`` to it (it gets :class:`ConnectionLost` if the
        connection ends). Concurrent callers share one connection.

        Raises:
            ReplicaUnreachable: the replica cannot be reached there.
            ConnectionLost: a connection to that replica ended since ``request_id`` was opened,
                so some of its deltas may have gone out on it.
        """
        address = (str(address[0]), int(address[1]))
        if self._last_end.get(address, 0) > self._opened_at.get(request_id, self._ended):
            raise ConnectionLost(f"the connection to replica {address[0]}:{address[1]} ended while this request started")
        connection = self._connections.get(address)
        if connection is None:
            connection = self._connections[address] = _Connection(address)
            connection.task = asyncio.create_task(self._read(connection))
        if request_id in self._queues:
            connection.requests.add(request_id)
        try:
            await asyncio.shield(connection.ready)
        except (OSError, asyncio.TimeoutError) as exc:
            raise ReplicaUnreachable(f"cannot connect to replica {address[0]}:{address[1]}: {exc!r}") from exc

    async def _read(self, connection: _Connection) -> None:
        """Open ``connection``, then dispatch its frames until it ends."""
        writer = None
        try:
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(*connection.address), CONNECT_TIMEOUT_S)
                writer.write(self.key.encode("ascii") + b"\n")
                await writer.drain()
            except BaseException as exc:
                if not connection.ready.done():
                    connection.ready.set_exception(exc)
                    connection.ready.exception()  # retrieved here; each waiter re-raises it
                raise
            connection.ready.set_result(None)
            queues = self._queues
            while True:
                header = await reader.readexactly(HEADER.size)
                (size,) = HEADER.unpack(header)
                items = pickle.loads(await reader.readexactly(size))
                for request_id, item in items:
                    queue = queues.get(request_id)
                    if queue is not None:
                        queue.put_nowait(item)
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # the connection ended or broke (a frame that does not decode)
            if connection.ready.done() and not connection.ready.exception():
                logger.warning("batched deltas: connection to %s:%d ended: %r", *connection.address, exc)
        finally:
            self._ended += 1
            self._last_end[connection.address] = self._ended
            if self._connections.get(connection.address) is connection:
                del self._connections[connection.address]
            for request_id in connection.requests:
                queue = self._queues.get(request_id)
                if queue is not None:
                    queue.put_nowait(ConnectionLost(f"the connection to replica {connection.address[0]}:{connection.address[1]} ended"))
            if writer is not None:
                writer.close()

    def shutdown(self) -> None:
        """Close every connection."""
        for connection in list(self._connections.values()):
            if connection.task is not None:
                connection.task.cancel()
