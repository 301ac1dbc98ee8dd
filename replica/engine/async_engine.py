"""asyncio streaming over :class:`~replica.engine.llm_engine.LLMEngine`, with the step loop on its own thread.

The loop thread owns the engine: callers never touch it directly. They send commands (add,
abort) through a thread-safe queue that the loop drains before every step, so an abort frees
its seat and blocks before the next step runs. Outputs go back to each request's
``asyncio.Queue`` on the caller's event loop. torch releases the GIL inside the forward, so the
event loop (HTTP, Serve) stays responsive while a step runs.

Failures: an error inside one step ends only the requests it concerns (see
``replica.engine.llm_engine``); they get :class:`RequestFailedError` and the loop goes on. If the engine
state is lost (``EngineStateError`` or any other escape from ``step()``), the loop stops, every
open request gets :class:`EngineDeadError` and :attr:`AsyncLLMEngine.is_alive` turns false; the
replica's health check then fails and Serve replaces the replica. :meth:`AsyncLLMEngine.stalled_for`
tells how long the loop has made no progress while work is queued (a wedged loop).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from replica.config.engine_config import EngineConfig
from replica.core.request import Request
from replica.engine.llm_engine import LLMEngine
from replica.engine.metrics import EngineMetrics
from replica.engine.request_builder import request_from_envelope
from replica.engine.request_streams import Sink, Stream, put_all
from replica.engine.stats import EngineStats
from replica.engine.thread_priority import lower_thread_priority
from replica.protocol.errors import EngineDeadError, RequestAbortedError, RequestFailedError
from replica.protocol.envelope import RequestEnvelope
from replica.protocol.outputs import EngineOutput, merge_queued
from replica.protocol.lora_request import LoRARequest
from replica.protocol.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


__all__ = ["AsyncLLMEngine", "EngineDeadError", "RequestAbortedError", "RequestFailedError"]


class AsyncLLMEngine:
    """Run an :class:`LLMEngine` on a background thread and stream each request's deltas.

    Args:
        config: engine settings (or an already built ``engine=``).
        metrics: Prometheus metrics the engine records into (see ``replica.engine.metrics``).
        launch_ranks: how a tensor-parallel engine starts its other ranks (``replica.worker.tp_launch``).
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        engine: LLMEngine | None = None,
        metrics: EngineMetrics | None = None,
        launch_ranks=None,
    ) -> None:
        self.engine = engine or LLMEngine(config or EngineConfig(), metrics=metrics, launch_ranks=launch_ranks)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, Stream] = {}
        self._streams_lock = threading.Lock()
        self._error: BaseException | None = None
        self._stopping = False
        self.last_step_time = time.monotonic()
        # When the loop last made progress: finished a step, or found nothing to do.
        self._last_progress = time.monotonic()
        self._injected_stall_s = 0.0  # fault injection (tests): sleep this long in the next step
        self._thread = threading.Thread(target=self._run, name="carpool-engine-loop", daemon=True)
        self._thread.start()

    # ---- public API --------------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def is_alive(self) -> bool:
        """The loop thread runs, has not failed, and its tensor-parallel group (if any) is whole."""
        return self._thread.is_alive() and self._error is None and not self.engine.runner.group_broken

    @property
    def dtype(self) -> str:
        """The model's dtype as a name (``"bfloat16"``, ``"float32"``)."""
        return str(self.engine.runner.dtype).removeprefix("torch.")

    def model_info(self) -> dict[str, Any]:
        """``max_model_len`` (tokens), ``vocab_size`` and ``eos_token_ids``: what requests are checked
        against; ``embedding_only``: the engine is a pooling engine (``replica/pooling``), which
        serves embedding requests alone; ``embedding_size``: ``[hidden size, Matryoshka sizes]``
        (:func:`~replica.protocol.pooling_params.check_dimensions` takes them)."""
        return {
            "max_model_len": self.engine.max_model_len,
            "vocab_size": self.engine.vocab_size,
            "eos_token_ids": list(self.engine.eos_token_ids),
            "embedding_only": bool(getattr(self.engine, "embedding_only", False)),
            "embedding_size": list(self.engine.embedding_size()),
        }

    def has_pending_commands(self) -> bool:
        """True while a command (add, abort, stop) waits for the loop thread."""
        return not self._commands.empty()

    def check_integrity(self) -> None:
        """:meth:`LLMEngine.check_integrity` (``AssertionError`` on a leaked or double-owned block).
        Only while idle: nothing queued or running, no command pending (the loop thread just waits)."""
        self.engine.check_integrity()

    def stats(self) -> EngineStats:
        """The engine's latest snapshot (taken by the loop thread after every step and command)."""
        return self.engine.stats()

    def stalled_for(self) -> float:
        """Seconds the loop has gone without progress (no step finished, not idle) while requests
        are queued or running or commands wait for it; 0.0 when it is idle or progressing."""
        s = self.engine.stats()
        if not (s.num_running or s.num_waiting or not self._commands.empty()):
            return 0.0
        return max(0.0, time.monotonic() - self._last_progress)

    def inject_stall(self, seconds: float) -> None:
        """Fault injection for tests: the loop thread sleeps ``seconds`` inside its next step
        that has work, as a wedged forward would. Needs ``EngineConfig.enable_fault_injection``.

        Raises ``RuntimeError`` when fault injection is not enabled.
        """
        if not self.engine.config.enable_fault_injection:
            raise RuntimeError("fault injection is disabled (EngineConfig.enable_fault_injection)")
        self._injected_stall_s = float(seconds)

    def abort_all(self, reason: str) -> None:
        """End every queued and running request (thread-safe); each open stream raises
        :class:`RequestAbortedError` with ``reason``. Used when the server shuts down."""
        self._commands.put(("abort_all", reason))

    async def make_request(self, envelope: RequestEnvelope) -> Request:
        """The :class:`Request` of an envelope, for :meth:`generate` or :meth:`run` (its adapter
        resolved once, its prompt checked against this ``max_model_len``, its constraint compiled:
        :func:`~replica.engine.request_builder.request_from_envelope`). In a worker thread only for
        a constraint or an adapter not in host memory yet (files to read). Raises ``ValueError``."""
        engine = self.engine
        make = functools.partial(
            request_from_envelope, envelope, max_model_len=engine.max_model_len, eos_token_ids=engine.eos_token_ids,
            grammar_compiler=engine.grammar_compiler, lora=engine.lora, scheduling_policy=engine.scheduler.scheduling_policy,
            check_pooling=engine.check_pooling,
        )
        lora = envelope.lora_request
        try:
            if envelope.sampling_params.structured_outputs is not None or (lora is not None and not self.lora_in_memory(lora)):
                return await asyncio.to_thread(make)
            return make()
        except ValueError:
            if engine.metrics is not None:
                engine.metrics.on_rejected()
            raise

    async def generate(
        self,
        request_id: str | Request,
        *,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        sampling_params: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[EngineOutput]:
        """Queue a request (with ``lora_request``: run with that adapter; or, as ``request_id``, a
        request made by :meth:`make_request`, and nothing else) and yield its deltas until it finishes. Deltas that pile up while the caller is busy come out merged into one.

        Raises ``ValueError`` (bad input, before anything is queued) or :class:`EngineDeadError`.
        Closing or cancelling the iterator early aborts the request inside the engine.
        """
        stream = Stream(asyncio.get_running_loop(), asyncio.Queue())
        request = await self._submit(request_id, prompt, prompt_token_ids, sampling_params, stream, lora_request)
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                item, error = merge_queued(item, stream.queue)  # only errors follow deltas here
                finished = item.finished or error is not None
                yield item
                if error is not None:
                    raise error
                if finished:
                    return
        finally:
            self._close(request, finished)

    async def run(
        self,
        request_id: str | Request,
        *,
        on_output: Callable[[EngineOutput], None],
        prompt_token_ids: list[int] | None = None,
        sampling_params: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request (as :meth:`generate` does) and call ``on_output(delta)`` with each of its deltas, on this event
        loop, as the engine steps; return once the last one (``finished``) was passed on.

        Unlike :meth:`generate`, deltas are not merged and no coroutine wakes up per delta: the
        engine thread's one hand-over per step calls ``on_output`` directly (the batched deltas
        of ``replica/serve/delta_channel.py``).

        Raises as :meth:`generate` (``ValueError``, :class:`RequestFailedError`,
        :class:`RequestAbortedError`, :class:`EngineDeadError`); cancelling the call aborts the
        request inside the engine.
        """
        loop = asyncio.get_running_loop()
        sink = Sink(on_output, loop.create_future())
        request = await self._submit(request_id, None, prompt_token_ids, sampling_params, Stream(loop, sink), lora_request)
        finished = False
        try:
            await sink.done
            finished = True
        except asyncio.CancelledError:
            raise
        except BaseException:
            finished = True
            raise
        finally:
            self._close(request, finished)

    def _close(self, request: Request, finished: bool) -> None:
        """Forget a request's stream; abort it inside the engine unless it ``finished`` (ended,
        or failed) first. The abort names this very request, not its id: a new request may
        take the id before the loop reads the command, and must not be aborted or get this
        one's final output."""
        if not finished:
            self._commands.put(("abort_closed", request))
        with self._streams_lock:
            self._streams.pop(request.request_id, None)

    async def _submit(
        self,
        request_id: str | Request,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        sampling_params: SamplingParams | None,
        stream: Stream,
        lora_request: LoRARequest | None = None,
    ) -> Request:
        """Make the request (unless ``request_id`` is one already), register its stream and queue
        it for the loop thread.

        Raises ``ValueError`` (bad input or a request id in use) or :class:`EngineDeadError`."""
        if self._error is not None:
            raise EngineDeadError(f"engine loop died: {self._error!r}")
        args = (request_id, prompt, prompt_token_ids, sampling_params, None, lora_request)
        if isinstance(request_id, Request):
            request = request_id
        elif lora_request is not None or (sampling_params is not None and sampling_params.structured_outputs is not None):
            # Compiling a new constraint, or reading an adapter, may take milliseconds: not on this event loop.
            request = await asyncio.to_thread(self.engine.make_request, *args)
        else:
            request = self.engine.make_request(*args)
        stream.request = request
        with self._streams_lock:
            if request.request_id in self._streams:
                raise ValueError(f"request_id {request.request_id!r} is already in use")
            self._streams[request.request_id] = stream
        self._commands.put(("add", request))
        return request

    # ---- LoRA -------------------------------------------------------------------------------------
    def check_lora(self, lora_request: LoRARequest) -> dict[str, Any]:
        """:meth:`LLMEngine.add_lora <replica.engine.llm_engine.LLMEngine.add_lora>`: read and check an
        adapter, which stays in host memory for the requests that follow (thread-safe; reads files:
        call it off the event loop). Raises ``LoRAAdapterError`` naming the reason."""
        return self.engine.add_lora(lora_request)

    def lora_in_memory(self, lora_request: LoRARequest) -> bool:
        """Whether the adapter is in host memory now, so that a request naming it reads no file
        and cannot be refused for its files (thread-safe; False without LoRA)."""
        lora = self.engine.lora
        return lora is not None and lora.registry.has(lora_request)

    def remove_lora(self, lora_name: str) -> bool:
        """:meth:`LLMEngine.remove_lora <replica.engine.llm_engine.LLMEngine.remove_lora>` (thread-safe)."""
        return self.engine.remove_lora(lora_name)

    def lora_stats(self) -> dict[str, Any] | None:
        """:meth:`LLMEngine.lora_stats <replica.engine.llm_engine.LLMEngine.lora_stats>` (thread-safe)."""
        return self.engine.lora_stats()

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe); its seat and blocks are free before the next step."""
        self._commands.put(("abort", request_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop thread, aborting whatever is still queued or running."""
        self._stopping = True
        self._commands.put(("stop", None))
        self._thread.join(timeout)
        if not self._thread.is_alive():  # else a step may still use the other ranks; they end with us
            self.engine.close()

    # ---- loop thread -------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        lower_thread_priority(engine.config.loop_thread_nice)
        try:
            while not self._stopping:
                block = not engine.has_unfinished_requests()
                self._drain_commands(block=block)
                if self._stopping:
                    break
                if self._injected_stall_s and engine.has_unfinished_requests():
                    stall, self._injected_stall_s = self._injected_stall_s, 0.0
                    logger.warning("fault injection: engine loop stalls for %.1f s", stall)
                    time.sleep(stall)
                outputs = engine.step()
                self.last_step_time = self._last_progress = time.monotonic()
                self._deliver_all([(output.request_id, output) for output in outputs])
        except BaseException as exc:  # deliver the error to every waiting caller, then stop
            logger.exception("engine loop failed")
            self._error = exc
            with self._streams_lock:
                streams = list(self._streams)
            self._deliver_all([(request_id, EngineDeadError(f"engine loop died: {exc!r}")) for request_id in streams],
                              to_unadded=True)
            return
        for request_id in list(engine.scheduler.requests):
            output = engine.abort(request_id)
            if output is not None:
                self._deliver(request_id, output)

    def _drain_commands(self, block: bool) -> None:
        while True:
            try:
                command, arg = self._commands.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                if block and not self._stopping:
                    self._last_progress = time.monotonic()  # idle, not stuck
                    continue
                return
            block = False
            if command == "stop":
                return
            if command == "add":
                request: Request = arg
                try:
                    self.engine.add_prepared_request(request)
                except Exception as exc:  # refuse this request only; the loop goes on
                    error = exc if isinstance(exc, ValueError) else ValueError(str(exc))
                    self._deliver_all([(request.request_id, error)], to_unadded=True)
                else:
                    with self._streams_lock:
                        stream = self._streams.get(request.request_id)
                        if stream is not None and stream.request is request:
                            stream.added = True
            elif command == "abort":
                output = self.engine.abort(arg)
                if output is not None:
                    self._deliver(arg, output)
            elif command == "abort_closed":  # its caller is gone: nothing to deliver
                if self.engine.scheduler.requests.get(arg.request_id) is arg:
                    self.engine.abort(arg.request_id)
            elif command == "abort_all":
                for request_id in list(self.engine.scheduler.requests):
                    if self.engine.abort(request_id) is not None:
                        self._deliver(request_id, RequestAbortedError(arg))

    def _deliver(self, request_id: str, item: EngineOutput | BaseException) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list[tuple[str, EngineOutput | BaseException]], *, to_unadded: bool = False) -> None:
        """Put each ``(request_id, item)`` on its request's stream, in order: one wake-up per event
        loop for all of them (a step's outputs come in one go, not one per request). An output
        with an error becomes :class:`RequestFailedError`; items of requests whose caller went
        away are dropped (their abort is queued), as are those of a closed event loop, and (unless
        ``to_unadded``) those for a stream whose request the loop has not added yet: they belong
        to an earlier request with the same id."""
        puts: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, EngineOutput | BaseException]]] = {}
        with self._streams_lock:
            for request_id, item in items:
                stream = self._streams.get(request_id)
                if stream is None or not (stream.added or to_unadded):
                    continue
                if isinstance(item, EngineOutput) and item.error is not None:
                    item = RequestFailedError(item.error)
                puts.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, queued in puts.items():
            try:
                loop.call_soon_threadsafe(put_all, queued)
            except RuntimeError:  # that event loop is closed
                pass

