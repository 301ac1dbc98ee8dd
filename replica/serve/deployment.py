"""The Serve replica: one :class:`~replica.engine.async_engine.AsyncLLMEngine` behind a Ray Serve deployment.

The ingress (``router/ingress.py``) tokenizes and validates; it calls :meth:`LLMReplica.generate`
through a ``DeploymentHandle`` with ``stream=True`` and one request's
:class:`~replica.protocol.envelope.RequestEnvelope` as the keyword ``request``. The engine's
:class:`~replica.core.request.EngineOutput` deltas go back over this replica's batched-delta server
(``replica/serve/delta_channel.py``: one frame per engine step for all of an ingress's requests), or
as the call's own stream items. When the ingress cancels the stream (its
client went away), Serve cancels this generator, and the engine aborts the request: its seat and
KV blocks are free before the next engine step.

The request router (``router/routing/policy.py``) ranks replicas by what :meth:`record_routing_stats`
reports; Serve's controller polls it every ``request_routing_stats_period_s``.

LoRA (``enable_lora``): a request's envelope may name a ``LoRARequest``; the engine reads that
adapter's files the first time it sees it. The adapter is resolved once per request, before the
request is admitted (:meth:`AsyncLLMEngine.make_request <replica.engine.async_engine.AsyncLLMEngine.make_request>`;
in a worker thread only when its files must be read), so a bad adapter is the caller's error
before anything streams, and no file is read on the event loop. The engine's LoRA state reaches Prometheus when ``/metrics`` is scraped
(:meth:`LLMReplica.metrics_text`).

All engine state lives on the engine's loop thread; this class only reads the engine's stats
snapshot (safe from any thread) and talks to the loop through ``generate``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from replica.config.engine_config import EngineConfig
from replica.engine.admission import Admission
from replica.protocol.envelope import RequestEnvelope
from replica.protocol.errors import ReplicaOverloadedError
from replica.protocol.lora_request import LoRARequest
from replica.protocol.outputs import EngineOutput
from replica.serve.delta_channel import DeltaChannels
from replica.serve.logs import log_refusals_in_one_line, log_through_serve
from replica.serve.replica_info import node_ip, replica_id

logger = logging.getLogger(__name__)



class LLMReplica:
    """Serve deployment body (``serve.deployment`` is applied in :func:`cluster.app.build_app`).

    Args:
        engine_config: the engine settings as a dict (``EngineConfig`` fields).
        num_threads: torch intra-op threads on CPU (one per reserved core).
        model_name: the served model's name (the metrics' ``model_name`` label).
        max_waiting_requests: requests held beyond the seats at most; ``None`` for no bound.
    """

    def __init__(
        self,
        engine_config: dict[str, Any],
        num_threads: int = 1,
        model_name: str | None = None,
        max_waiting_requests: int | None = None,
    ) -> None:
        log_through_serve()
        log_refusals_in_one_line()
        config = EngineConfig(**engine_config)
        if config.device == "cpu":
            import torch

            # One replica per core: a second thread on a shared core makes every step much slower.
            torch.set_num_threads(max(1, num_threads))
        from replica.engine.async_engine import AsyncLLMEngine
        from replica.engine.metrics import EngineMetrics

        self.config = config
        self._replica_id = replica_id()
        self.metrics = EngineMetrics(model_name=model_name or config.model, replica=self._replica_id)
        launch_ranks = None
        if config.tensor_parallel_size > 1:  # ranks 1..N-1 in this replica's placement group
            from replica.serve.tp_ranks import PlacementGroupLauncher

            launch_ranks = PlacementGroupLauncher(num_gpus=1 if config.device.startswith("cuda") else 0)
        from replica.pooling import pooling_engine_for  # an embedding model's engine (None: LLMEngine)

        pooling = pooling_engine_for(config, self.metrics)
        self.engine = AsyncLLMEngine(config, engine=pooling, metrics=self.metrics, launch_ranks=launch_ranks)
        self.channels = DeltaChannels(node_ip(), on_lost=self._abort_requests)
        self._inflight = 0  # generate() calls between their first and last line
        self._num_requests = 0  # generate() calls since start
        self.admission = Admission(self.engine.stats, on_shed=lambda: self.metrics.on_slo("shed"))
        self.max_admitted = None if max_waiting_requests is None else config.max_num_seqs + max_waiting_requests
        logger.info(
            "replica %s ready: model=%s dtype=%s device=%s seats=%d blocks=%d max_model_len=%d",
            self._replica_id, config.model, self.engine.dtype,
            config.device, config.max_num_seqs,
            self.engine.stats().num_total_blocks, self.engine.max_model_len,
        )

    # ---- requests ----------------------------------------------------------------------------
    async def generate(
        self,
        request: RequestEnvelope,
        announce: bool = False,
        channel: str | None = None,
    ) -> AsyncIterator[EngineOutput | tuple[str, int] | None]:
        """Run one request (its :class:`~replica.protocol.envelope.RequestEnvelope`, ``n`` 1: the
        ingress fans ``n`` out; under its LoRA adapter if it names one) and yield its deltas. The
        ingress passes ``request`` by keyword (:data:`~replica.protocol.envelope.ENVELOPE_KEYWORD`):
        the request router reads its routing hints there. The envelope is trusted; its adapter is
        resolved and its prompt checked against this engine's ``max_model_len``
        (:meth:`AsyncLLMEngine.make_request <replica.engine.async_engine.AsyncLLMEngine.make_request>`)
        before the admission, so that a refusal comes before a stream's response starts.

        With ``announce``, the first item is ``None`` as soon as the request is admitted, so that a
        streaming caller learns of a refusal before it starts its response.

        With ``channel`` (an ingress's key, see ``replica/serve/delta_channel.py``) and ``announce``, the
        first item is instead the ``(host, port)`` of this replica's batched-delta server, and the
        request's deltas, or the error that ends it, go to that ingress's connection there, in one
        frame per engine step with its other requests' deltas; this call then yields nothing more
        and ends when the request has ended (errors past the admission travel as items of the
        connection, not as this call's exception).

        Raises:
            ReplicaOverloadedError: the replica already holds ``max_num_seqs +
                max_waiting_requests`` requests; nothing is queued.
            replica.protocol.errors.LatencyTargetError: the request asked to be shed rather than
                served late, and its predicted TTFT here exceeds its target; nothing is queued.
            replica.protocol.errors.LoRAAdapterError: the adapter cannot be used (or LoRA is
                off); nothing is queued, nothing was yielded.
            ValueError: the request cannot be served (a prompt too long for this engine's
                ``max_model_len``: ``RequestError``; a constraint that does not compile for its
                tokenizer; a request id in use); nothing is queued.
            replica.protocol.errors.RequestFailedError: an internal error ended this request
                (the engine goes on serving the others).
            replica.protocol.errors.RequestAbortedError: the server ended it (shutting down).
            replica.protocol.errors.EngineDeadError: the engine loop died (the health check then
                fails and Serve restarts this replica).
        """
        if self.max_admitted is not None and self._inflight >= self.max_admitted:
            self.metrics.on_rejected()
            raise ReplicaOverloadedError(
                f"replica is full: {self._inflight} requests held, at most {self.max_admitted} "
                "(max_num_seqs + max_waiting_requests)"
            )
        self._inflight += 1
        self._num_requests += 1
        try:
            prepared = await self.engine.make_request(request)
            request_id = prepared.request_id
            self.admission.admit(request)
            if channel is not None and announce:
                address = await self.channels.address()
                sink = self.channels.acquire(channel, request_id)
                try:
                    yield address
                    try:
                        await self.engine.run(prepared, on_output=lambda delta: sink.put(request_id, delta))
                    except Exception as exc:  # ends this request: its ingress learns it in order
                        sink.put(request_id, exc)
                finally:
                    self.channels.release(sink, request_id)
                return
            if announce:
                yield None
            # aclosing: when Serve closes this generator while it waits at a yield (the client
            # went away), engine.generate is closed at once, which queues the engine's abort,
            # rather than whenever the event loop finalizes it.
            async with aclosing(self.engine.generate(prepared)) as deltas:
                async for delta in deltas:
                    yield delta
        finally:
            # Cancellation (client gone) lands here too, after the abort is queued.
            self._inflight -= 1
            self.admission.release(request.request_id)

    def _abort_requests(self, request_ids: list[str]) -> None:
        """Abort these requests in the engine (their ingress is gone: its delta connection ended)."""
        for request_id in request_ids:
            self.engine.abort(request_id)

    async def generate_all(self, request: RequestEnvelope) -> EngineOutput:
        """Run one request (an envelope, by keyword, as in :meth:`generate`) to the end and return
        its whole output as one :class:`EngineOutput` (all tokens, text and logprobs; ``finished=True``).

        For non-streaming callers: one message per request instead of one per token. Errors as
        :meth:`generate`; cancelling the call aborts the request.
        """
        whole: EngineOutput | None = None
        async for delta in self.generate(request):
            whole = delta if whole is None else whole.merged(delta)
        assert whole is not None and whole.finished
        if request.sampling_params.logprobs is not None and whole.new_logprobs is None:
            whole.new_logprobs = []
        return whole

    # ---- LoRA adapters -------------------------------------------------------------------------
    async def check_lora(self, lora_request: LoRARequest) -> dict[str, Any]:
        """Read and check an adapter (in a worker thread: it reads files) and keep it in host
        memory. Returns ``{"name", "path", "rank", "target_modules"}``.

        Raises:
            replica.protocol.errors.LoRAAdapterError: the adapter cannot be used (missing files,
                not LoRA, rank above ``max_lora_rank``, modules or shapes that do not fit the
                base model, LoRA off); the message names the reason.
        """
        return await asyncio.to_thread(self.engine.check_lora, lora_request)

    async def remove_lora(self, lora_name: str) -> bool:
        """Forget the adapter(s) named ``lora_name`` from host memory (requests running with one
        keep it; a later request that names it reads it again). Returns whether one was known."""
        if not self.config.enable_lora:
            return False
        removed = self.engine.remove_lora(lora_name)
        self._refresh_lora_metrics()
        return removed

    async def lora_stats(self) -> dict[str, Any]:
        """The engine's adapters: ``max_loras``, ``loaded`` (names in device slots), ``cached``
        (names in host memory), ``running`` and ``waiting`` (``{name: requests}``),
        ``num_slot_loads`` (loads into a device slot since start). Empty lists and counts when LoRA
        is off."""
        return self._lora_stats()

    def _lora_stats(self) -> dict[str, Any]:
        stats = self.engine.lora_stats() if self.config.enable_lora else None
        if stats is None:
            return {"max_loras": 0, "loaded": [], "cached": [], "running": {}, "waiting": {}, "num_slot_loads": 0}
        return stats

    def _refresh_lora_metrics(self) -> None:
        if self.config.enable_lora:
            self.metrics.on_lora_stats(self._lora_stats())

    async def model_info(self) -> dict[str, Any]:
        """What the ingress needs to validate and route requests: ``max_model_len`` (tokens),
        ``vocab_size``, ``eos_token_ids``, ``max_num_seqs``, ``block_size`` (tokens per KV block:
        the prefix hashes of the envelopes' routing hints), ``scheduling_policy`` (``"fcfs"``: a
        request's ``priority`` must be 0)."""
        return {**self.engine.model_info(), "max_num_seqs": self.config.max_num_seqs, "block_size": self.config.block_size,
                "scheduling_policy": self.config.scheduling_policy}

    async def metrics_text(self) -> str:
        """This replica's ``carpool:*`` series in the Prometheus text format (the ingress merges
        every replica's into ``GET /metrics``); the LoRA series are refreshed from the engine first."""
        self._refresh_lora_metrics()
        return self.metrics.exposition().decode()

    # ---- load, health, integrity -------------------------------------------------------------
    def _stats_dict(self) -> dict[str, Any]:
        s = self.engine.stats()
        return {
            "replica": self._replica_id,
            "num_slots": s.num_slots,
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "free_seats": max(0, s.num_slots - s.num_running),
            "num_free_blocks": s.num_free_blocks,
            "num_total_blocks": s.num_total_blocks,
            "block_size": self.config.block_size,
            "kv_cache_usage": s.kv_cache_usage,
            "num_preemptions": s.num_preemptions,
            "num_steps": s.num_steps,
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
            "num_cached_blocks": s.num_cached_blocks,
            "inflight": self._inflight,
            "num_requests": self._num_requests,
            "pid": os.getpid(),
            "healthy": self.engine.is_alive and self._wedged_for() is None,
            "lora_loaded": self._lora_stats()["loaded"],
            "priority_counts": [list(pair) for pair in s.priority_counts],
        }

    async def record_routing_stats(self) -> dict[str, Any]:
        """Load report for the request router (Serve polls it): seats, queue, KV blocks.

        Keys: ``num_slots`` (seats = ``max_num_seqs``), ``num_running``, ``num_waiting``,
        ``free_seats``, ``num_free_blocks``, ``num_total_blocks``, ``block_size`` (tokens per KV
        block: the router hashes prompts in blocks of this size), ``kv_cache_usage`` (0-1),
        ``num_preemptions``, ``num_steps``, ``prefix_cache_queries`` and ``prefix_cache_hits``
        (tokens since start), ``num_cached_blocks``, ``inflight`` (requests this replica is streaming),
        ``num_requests`` (requests received since start), ``replica`` (Serve replica id),
        ``pid`` (the replica's process id), ``healthy`` (False when the engine loop is dead or
        wedged: the router then sends requests elsewhere until Serve replaces this replica),
        ``lora_loaded`` (names of the LoRA adapters in device slots; adapter-aware routing),
        ``priority_counts`` (priority scheduling policy only, else empty: ``[[priority, requests
        running or waiting], ...]``, lowest value first, at most 16 pairs; priority-aware routing).
        """
        return self._stats_dict()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """What the Carpool autoscaling policy scales on (``cluster/autoscaling/policy.py``); Serve
        calls it every few seconds when the deployment autoscales and averages each key over its
        look-back window. Keys: ``num_running``, ``num_slots`` (seats), ``num_waiting`` (requests),
        ``queue_wait_s`` (how long the head of the waiting queue has waited, seconds),
        ``kv_cache_usage`` (fraction of KV blocks in use, 0-1)."""
        s = self.engine.stats()
        return {
            "num_running": float(s.num_running),
            "num_slots": float(s.num_slots),
            "num_waiting": float(s.num_waiting),
            "queue_wait_s": s.queue_wait_s(time.monotonic()),
            "kv_cache_usage": float(s.kv_cache_usage),
        }

    async def stats(self) -> dict[str, Any]:
        """Same as :meth:`record_routing_stats` (for callers that hold a handle)."""
        return self._stats_dict()

    def _is_quiescent(self) -> bool:
        """True when no request exists anywhere: none streaming here, no command on its way to
        the loop thread, and the loop's snapshot shows no request and every block free. Then the
        loop thread only waits for commands, and reading engine state from here is safe."""
        s = self.engine.stats()
        return (
            self._inflight == 0
            and not self.engine.has_pending_commands()
            and s.num_running == 0
            and s.num_waiting == 0
            and s.num_free_blocks == s.num_total_blocks
        )

    async def check_integrity(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """Wait (up to ``timeout_s``) until the replica is idle, then check the KV block accounting.

        Returns the stats dict. Raises ``AssertionError`` on a leaked or double-owned block and
        ``TimeoutError`` if requests are still running or waiting after ``timeout_s`` (the stats
        are in the message).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self._is_quiescent():
            if loop.time() > deadline:
                raise TimeoutError(f"replica not idle after {timeout_s}s: {self._stats_dict()}")
            await asyncio.sleep(0.01)
        # No await between the idle check and the check itself: no request can start meanwhile.
        self.engine.check_integrity()
        return self._stats_dict()

    def _wedged_for(self) -> float | None:
        """Seconds the engine loop has made no progress with work queued, if that is over
        ``stall_timeout_s`` (the loop is wedged); else None."""
        stalled = self.engine.stalled_for()
        return stalled if stalled > self.config.stall_timeout_s else None

    async def check_health(self) -> None:
        """Serve's health check: the engine loop must be alive and making progress; when idle,
        blocks must add up.

        Raises ``RuntimeError`` (engine loop dead, or wedged: no step finished for more than
        ``stall_timeout_s`` while work is queued) or ``AssertionError`` (KV accounting broken),
        and Serve then replaces this replica.
        """
        if not self.engine.is_alive:
            raise RuntimeError("engine loop is not running")
        stalled = self._wedged_for()
        if stalled is not None:
            raise RuntimeError(
                f"engine loop wedged: no step for {stalled:.1f} s with work queued "
                f"(stall_timeout_s={self.config.stall_timeout_s})"
            )
        if self._is_quiescent():
            self.engine.check_integrity()

    async def abort_all(self, reason: str = "the server is shutting down") -> int:
        """End every request on this replica (shutdown after its grace period); each client gets
        a 503 with ``reason``. Returns how many requests were streaming here."""
        inflight = self._inflight
        self.engine.abort_all(reason)
        return inflight

    async def inject_stall(self, seconds: float) -> None:
        """Testing only (``enable_fault_injection``): wedge the engine loop for ``seconds`` in its
        next step with work. Raises ``RuntimeError`` when fault injection is disabled."""
        self.engine.inject_stall(seconds)

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(timeout=2.0)
        channels = getattr(self, "channels", None)
        if channels is not None:
            channels.close()




