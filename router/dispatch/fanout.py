"""Running a prepared request on the replicas: one replica request per choice.

Owns: fanning the choices out through the ``LLMReplica`` handle, streamed
(:meth:`Fanout.open_streams`, :meth:`Fanout.deltas`) or not (:meth:`Fanout.run_all`); starting
a choice again, once, on another replica when its replica died before the first delta reached the
client (each choice a :class:`~router.dispatch.choice_stream.ChoiceStream`); cancelling every replica request
of a response however it ends (:func:`~router.dispatch.choice_stream.cancel_all`); the
count of requests in flight; and the shutdown drain (:meth:`Fanout.drain`): 503 for new requests,
a grace period for those in flight, then the rest ended on every replica.
"""

# No "from __future__ import annotations", as in router/ingress.py.

import asyncio
import functools
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, Optional

from ray.serve.handle import DeploymentHandle

from replica.protocol.outputs import EngineOutput
from replica.protocol.sampling_params import SamplingParams
from router.dispatch.choice_stream import ChoiceStream, cancel, cancel_all, replica_gone
from router.dispatch.delta_receiver import DeltaReceiver, ReplicaUnreachable, on_call_end, queued_deltas
from router.dispatch.replica_view import ReplicaView, unavailable
from router.request.errors import StreamError, replica_error
from router.request.preparation import Prepared
from router.request.protocol import OpenAIError

logger = logging.getLogger(__name__)


def _ended_error() -> OpenAIError:
    """A request ended because the server shuts down and its grace period is over."""
    return OpenAIError("the server is shutting down", 503, type="service_unavailable_error", code="unavailable")


def _retrieve(task: asyncio.Future) -> None:
    """Mark a finished task's exception as seen (asyncio logs "never retrieved" otherwise)."""
    if not task.cancelled():
        task.exception()


MAX_UNREACHABLE = 3
"""After this many failed batched-delta connections in a row (a network that refuses the replicas'
ports, not one replica that died), the ingress streams every request through Ray."""


class Fanout:
    """Runs prepared requests on the replicas and keeps the ingress's shutdown state.

    Args:
        replica: handle of the ``LLMReplica`` deployment.
        view: the deployment's view; a choice is started again only while some replica can serve.
        receiver: batched deltas (``IngressConfig.batched_deltas``): streamed choices get their
            deltas through it, one frame per engine step and replica; None: one Ray stream item per
            delta. A choice whose replica's address cannot be reached starts again through Ray,
            and after :data:`MAX_UNREACHABLE` such failures in a row every new one does.
    """

    def __init__(self, replica: DeploymentHandle, view: ReplicaView, receiver: Optional[DeltaReceiver] = None) -> None:
        self.replica = replica
        self.stream_handle = replica.options(stream=True)
        self.view = view
        self.receiver = receiver
        self._unreachable = 0  # batched-delta connections that failed in a row
        self.draining = False  # shutting down: new generation requests get 503
        self._ended = asyncio.Event()  # shutting down and the grace period is over
        self._inflight = 0  # generation requests being answered (streams until their last event)
        self._opening = 0  # streamed requests waiting for their replicas' admission (open_streams)

    # ---- admission and shutdown --------------------------------------------------------------
    def admit(self) -> None:
        """Raises :class:`OpenAIError` 503 ``shutting_down`` once :meth:`drain` has begun."""
        if self.draining:
            raise OpenAIError("the server is shutting down", 503, type="service_unavailable_error", code="shutting_down")

    async def drain(self, timeout_s: float) -> dict[str, int]:
        """Stop admitting (new generation requests get 503 ``shutting_down``), wait up to
        ``timeout_s`` seconds for the requests in flight to finish, then end the rest on every
        replica (their clients get a 503 error: JSON, or an error event and ``[DONE]``).

        Returns ``in_flight`` (when draining started), ``finished`` (completed within the grace
        period) and ``ended`` (cut off).
        """
        self.draining = True
        at_start = self._busy()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._busy() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        remaining = self._busy()
        # Requests still waiting for a replica (in Serve's queue while none can take them: a retry
        # after a replica died, or a request routed just before) reach no replica's abort_all.
        self._ended.set()
        if remaining:
            logger.warning("shutdown grace period over: ending %d requests", remaining)
            try:
                await self.replica.broadcast("abort_all", "the server is shutting down").results_async(
                    timeout_s=10.0, return_exceptions=True
                )
            except Exception as exc:  # e.g. DeploymentUnavailableError: no replica is running
                logger.warning("ending the requests on the replicas failed: %r", exc)
            deadline = loop.time() + 10.0
            while self._busy() and loop.time() < deadline:
                await asyncio.sleep(0.05)
        return {"in_flight": at_start, "finished": at_start - remaining, "ended": remaining}

    def _busy(self) -> int:
        """Generation requests in flight (answered, or waiting for their streams' admission)."""
        return self._inflight + self._opening

    async def counted(self, frames: AsyncIterator[str]) -> AsyncIterator[str]:
        """``frames`` (a streamed response's), counted as in flight from the first frame to the
        last (or the disconnect), so that :meth:`drain` waits for them."""
        self._inflight += 1
        try:
            async for frame in frames:
                yield frame
        finally:
            self._inflight -= 1

    async def _unless_ended(self, awaitable: Any) -> Any:
        """Await a handle call (an admission or a ``generate_all`` result) unless the shutdown
        grace period ends first (:meth:`drain`): then raise 503 (the caller cancels the call).
        A call in Serve's queue waits for a replica that may not come before the server stops."""
        if self._ended.is_set():
            raise _ended_error()
        call = asyncio.ensure_future(awaitable)
        call.add_done_callback(_retrieve)  # a call cancelled with its caller may still end in an error
        ended = asyncio.ensure_future(self._ended.wait())
        try:
            await asyncio.wait((call, ended), return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
            if not call.done():
                call.cancel()
        if call.done():
            return call.result()
        raise _ended_error()

    # ---- streamed ------------------------------------------------------------------------------
    async def open_streams(self, prepared: Prepared) -> list[ChoiceStream]:
        """Fan the request out (one replica stream per choice) and wait until every replica has
        admitted its part, so that a refusal is an HTTP status (429 when a replica is full), not
        an error event in a stream that has already begun. A choice whose replica is gone before
        admitting it is started again once elsewhere (:meth:`_may_retry`).

        Raises :class:`OpenAIError`; then, or if this call is cancelled, every stream is cancelled.
        """
        streams = []
        for index, p, _, params in prepared.jobs():
            s = ChoiceStream(index, prepared.envelope(index, p, params), None, self.receiver)
            self._start(s)
            streams.append(s)
        self._opening += 1
        try:
            for s in streams:
                try:
                    await self._admitted(s)
                except Exception as exc:
                    if not await self._may_retry(s, exc):
                        raise
                    await self._restart(s, exc)
        except BaseException as exc:
            cancel_all(streams)
            if isinstance(exc, Exception):
                raise replica_error(exc) from None
            raise
        finally:
            self._opening -= 1
        return streams

    def _start(self, s: ChoiceStream) -> None:
        """Send choice ``s`` to a replica (``generate``, streamed, announcing its admission; its
        envelope as the keyword ``request``, where the request router reads its hints); with
        batched deltas, register its queue first."""
        channel = None
        if s.receiver is not None:
            s.queue = s.receiver.open(s.request_id)
            channel = s.receiver.key
        s.gen = self.stream_handle.generate.remote(request=s.envelope, announce=True, channel=channel)

    async def _admitted(self, s: ChoiceStream) -> None:
        """Wait for choice ``s``'s admission (the call's first item). With batched deltas that item
        is the replica's address: connect there (once per replica) and watch the call's end.

        Raises what the admission raises, or what connecting raises
        (:class:`~router.dispatch.delta_receiver.ReplicaUnreachable`,
        :class:`~router.dispatch.delta_receiver.ConnectionLost`: :func:`replica_gone` lets the choice
        start again)."""
        first = await self._unless_ended(s.gen.__anext__())
        if s.queue is None:
            return
        try:
            await self._unless_ended(s.receiver.connect(first, s.request_id))
        except ReplicaUnreachable:
            self._unreachable += 1
            if self._unreachable >= MAX_UNREACHABLE and self.receiver is not None:
                logger.warning("batched deltas: %d replica addresses in a row unreachable; streaming through Ray from now on", self._unreachable)
                self.receiver = None
            raise
        self._unreachable = 0
        s.watch = asyncio.ensure_future(s.gen.__anext__())
        s.watch.add_done_callback(functools.partial(on_call_end, s.queue))

    async def _may_retry(self, s: ChoiceStream, exc: BaseException) -> bool:
        """Whether a choice that failed with ``exc`` before its first delta may start again:
        its replica is gone (:func:`replica_gone`), it has not been retried yet, the server is
        not shutting down, and some replica can serve (otherwise the retry would only wait in
        Serve's queue)."""
        if s.retried or self.draining or not replica_gone(exc):
            return False
        return not unavailable(await self.view.current())

    async def _restart(self, s: ChoiceStream, exc: BaseException) -> None:
        """Start choice ``s`` again (the second and last time) and wait for its admission. Serve's
        router has marked the dead replica as such, so another one takes it.

        Raises what the new admission raises."""
        s.release()
        s.start_over(exc)
        if isinstance(exc, ReplicaUnreachable):  # perhaps the network refuses the port: go by Ray
            logger.warning("batched deltas: %s; this request streams through Ray instead", exc)
            s.receiver = None
        self._start(s)
        await self._admitted(s)

    async def _choice_deltas(self, s: ChoiceStream) -> AsyncIterator[EngineOutput]:
        """The deltas of one admitted choice. If its replica is gone before the first delta (so
        nothing of this choice has reached the client), the choice starts again once on another
        replica and its deltas follow from there."""
        started = False
        while True:
            try:
                async for delta in (s.gen if s.queue is None else queued_deltas(s.queue, s.watch)):
                    started = True
                    yield delta
                return
            except Exception as exc:
                if started or not await self._may_retry(s, exc):
                    raise
                await self._restart(s, exc)

    async def _stream_choices(self, streams: list[ChoiceStream]) -> AsyncIterator[tuple[int, EngineOutput]]:
        """Yield ``(choice index, delta)`` from the admitted streams (:meth:`open_streams`) as
        deltas arrive (:meth:`_choice_deltas`). Closing this generator cancels every replica
        request still running."""
        if len(streams) == 1:
            s = streams[0]
            try:
                async with aclosing(self._choice_deltas(s)) as deltas:
                    async for delta in deltas:
                        yield s.index, delta
            finally:
                s.release()
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(s: ChoiceStream) -> None:
            try:
                async with aclosing(self._choice_deltas(s)) as deltas:
                    async for delta in deltas:
                        queue.put_nowait((s.index, delta))
                queue.put_nowait((s.index, done))
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # delivered to the consumer
                queue.put_nowait((s.index, exc))

        tasks = [asyncio.create_task(pump(s)) for s in streams]
        remaining = len(tasks)
        try:
            while remaining:
                index, item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            cancel_all(streams)

    async def deltas(self, streams: list[ChoiceStream]) -> AsyncIterator[tuple[int, EngineOutput]]:
        """``(choice index, delta)`` of every admitted stream (:meth:`open_streams`) as deltas
        arrive. Raises :class:`~router.request.errors.StreamError` (one OpenAI error) when a replica
        request fails; closing it cancels every replica request still running."""
        try:
            async for item in self._stream_choices(streams):
                yield item
        except Exception as exc:
            raise StreamError(replica_error(exc)) from None

    # ---- not streamed ----------------------------------------------------------------------------
    async def run_all(self, prepared: Prepared) -> list[EngineOutput]:
        """Non-streaming: one ``generate_all`` call per choice (one message back, not one per
        token); returns each job's whole output, in the order of ``prepared.jobs()``. A choice
        whose replica is gone is started again once on another replica (nothing of it has reached
        the client). If this handler is cancelled (client gone), or one choice fails, the calls
        are cancelled too.

        Raises:
            OpenAIError: the first failure, mapped by :func:`~router.request.errors.replica_error`.
        """

        async def run(index: int, prompt_index: int, params: SamplingParams) -> EngineOutput:
            s = ChoiceStream(index, prepared.envelope(index, prompt_index, params))
            while True:
                s.gen = self.replica.generate_all.remote(request=s.envelope)
                try:
                    return await self._unless_ended(s.gen)
                except Exception as exc:
                    if not await self._may_retry(s, exc):
                        raise
                    s.start_over(exc)
                finally:
                    cancel(s.gen)

        self._inflight += 1
        tasks = [asyncio.create_task(run(index, p, params)) for index, p, _, params in prepared.jobs()]
        try:
            return list(await asyncio.gather(*tasks))
        except Exception as exc:
            raise replica_error(exc) from None
        finally:
            self._inflight -= 1
            for task in tasks:
                task.cancel()  # no-op for the finished ones
