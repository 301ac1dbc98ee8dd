"""The HTTP ingress: an OpenAI-compatible API (FastAPI) deployed on Ray Serve.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /v1/models/{id}``, ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``
(:mod:`router.responses`), ``POST /v1/load_lora_adapter``, ``POST /v1/unload_lora_adapter``,
``POST /v1/embeddings`` (:mod:`router.embeddings`), ``GET /health``, ``GET /metrics``. A request's ``model`` is the served model or one of its LoRA
adapters (:mod:`router.lora.adapters`; the adapter travels with each replica request). Each request is validated (pydantic
models in :mod:`router.request.protocol`), its chat template applied and its prompt tokenized **once, here**; the
replicas receive token ids. A request with ``n`` choices (or several prompts) becomes one replica
request per choice, choice ``j`` of each prompt of a seeded request using ``seed + j``. Replica
requests go through a ``DeploymentHandle``; a streamed one's tokens come back over the replica's
batched-delta connection (:mod:`router.dispatch.delta_receiver`; one message per engine step for all of
this ingress's requests there) or, with ``batched_deltas`` off, as the call's own stream. Outputs
leave as one JSON body or as server-sent events ending in ``data: [DONE]``.

Errors are OpenAI's JSON shape ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad
body or parameter, or one past a configured cap (the message names the field), 401 for a missing
or wrong API key, 404 for an unknown model or path, 413 for a body over ``max_request_body_bytes``,
415 for a non-JSON ``Content-Type``, 429 (with ``Retry-After``) when the chosen replica is full,
503 when no replica can serve. A client's mistake never yields a 500. The API key and the body
size are checked by :class:`~router.request.errors.RequestGuard` before routing; every error response is
counted in ``carpool:http_requests_rejected_total``.

A choice whose replica died (or whose engine loop died) before its first delta reached the
client is started again, once, on another replica.

When the HTTP client goes away mid-stream, Serve cancels this handler; the ``finally`` blocks
cancel every replica stream of the request, and each replica aborts its engine request.

This module holds the FastAPI app, the Serve deployment class and its endpoints, each a few calls
into the modules that do the work: :mod:`router.request.errors` (error responses, API key and body size),
:mod:`router.request.preparation` (checks, chat template, tokens, sampling parameters),
:mod:`router.dispatch.replica_view` (health, availability, capacity, model limits), :mod:`router.dispatch.fanout`
(replica requests, retry, cancel, shutdown drain), :mod:`router.response.responses` (bodies and SSE) and
:mod:`router.lora.adapters` (LoRA adapters: which model ids they are, loads and unloads). The one
patch of Ray Serve's internals it needs (``SO_REUSEADDR`` on the direct-ingress socket) is
:mod:`router.ray_compat`'s, checked against the installed Ray.
"""

# No "from __future__ import annotations": Serve rebuilds the route signatures and must see real types.

import logging
from collections.abc import AsyncIterator
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.handle import DeploymentHandle

from replica.config.engine_config import EngineConfig
from router.config import IngressConfig
from router.dispatch.choice_stream import ChoiceStream, cancel_all
from router.dispatch.delta_receiver import DeltaReceiver
from router.dispatch.fanout import Fanout
from router.dispatch.replica_view import ReplicaView
from router.embeddings.protocol import EmbeddingRequest
from router.embeddings.service import Embeddings
from router.lora.adapters import Adapters
from router.ray_compat import reuse_address_for_direct_ingress
from router.request.body_checks import BodyChecks
from router.request.errors import JSONBody, configure, install
from router.request.preparation import Prepared, RequestPreparer
from router.request.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    OpenAIError,
    UnloadLoRAAdapterRequest,
)
from router.request.slo_headers import latency_targets
from router.response.responses import EventStream, ResponseFormatter, sse_frames
from router.responses import events as response_events
from router.responses.api import ResponsesAPI, responses_error
from router.responses.protocol import ResponsesRequest
from router.responses.store import open_store

logger = logging.getLogger(__name__)


# JSONBody: a lone surrogate a client sent (metadata, user, model) comes back escaped, not as a 500.
app = FastAPI(title="Carpool", description="OpenAI-compatible LLM serving on Ray Serve.", default_response_class=JSONBody)
install(app)


@serve.ingress(app)
class OpenAIIngress:
    """Serve deployment body (options are set in :func:`cluster.app.build_app`).

    Args:
        replica: handle of the ``LLMReplica`` deployment.
        config: the :class:`~router.config.IngressConfig` fields as a dict
            (:meth:`~router.config.IngressConfig.ingress_fields`).
        engine: the replicas' engine settings as a dict (:class:`~replica.config.engine_config.EngineConfig`
            fields); the ingress reads ``model``, ``tokenizer`` and ``max_num_seqs``.
        lora_registry: handle of the :class:`~router.lora.lora_registry.LoRARegistry` deployment when
            LoRA is on (``enable_lora``), else None.
        response_store: handle of the ``ResponseStore`` deployment
            (:mod:`router.responses.store_deployment`) when ``response_store`` is ``serve``, else None.
    """

    def __init__(
        self, replica: DeploymentHandle, config: dict[str, Any], engine: dict[str, Any],
        lora_registry: Optional[DeploymentHandle] = None, response_store: Optional[DeploymentHandle] = None,
    ) -> None:
        from replica.config import load_tokenizer, resolve_model_path
        from replica.serve import log_through_serve, replica_id, serve_app_name
        from router.observability.metrics import IngressMetrics

        log_through_serve()
        self.config = IngressConfig(**config)
        engine_config = EngineConfig(**engine)
        self.root_model = engine_config.model
        self.model_name = self.config.served_name(self.root_model)
        self.tokenizer = load_tokenizer(resolve_model_path(engine_config.tokenizer or self.root_model, weights=False))
        self.metrics = IngressMetrics(model_name=self.model_name, replica=replica_id())
        self.app_name = serve_app_name()  # its autoscaler record's key
        configure(self.config.api_key, self.config.max_request_body_bytes, self.metrics)
        self.replicas = ReplicaView(replica, seats=engine_config.max_num_seqs, waiting=self.config.max_waiting_requests)
        self.checks = BodyChecks(self.config)
        self.adapters = Adapters(lora_registry, replica, self.config, self.model_name)
        self.preparer = RequestPreparer(self.config, self.tokenizer, self.model_name)
        self.fanout = Fanout(replica, self.replicas, DeltaReceiver() if self.config.batched_deltas else None)
        self.responses = ResponseFormatter(self.tokenizer)
        self.embedder = Embeddings(self.config, self.tokenizer, self.model_name)
        store = open_store(self.config.response_store, self.config.response_store_options, response_store)
        self.responses_api = ResponsesAPI(store, self.model_name, self.config.response_store_max_bytes)
        reuse_address_for_direct_ingress()  # before Serve starts this replica's HTTP server

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health(self) -> JSONResponse:
        """200 once every replica has loaded its model, and from then on while at least one
        replica is running (a replaced replica leaves the others serving); 503 before start-up
        completes, while no replica can serve, and while the server shuts down."""
        if self.fanout.draining:
            return JSONResponse({"status": "shutting_down", "detail": "the server is shutting down"}, status_code=503)
        ok, detail = await self.replicas.healthy()
        return JSONResponse({"status": "ok" if ok else "unavailable", "detail": detail}, status_code=200 if ok else 503)

    async def drain(self, timeout_s: float) -> dict[str, int]:
        """Stop admitting (new generation requests get 503 ``shutting_down``), wait up to
        ``timeout_s`` seconds for the requests in flight to finish, then end the rest on every
        replica (their clients get a 503 error: JSON, or an error event and ``[DONE]``).

        Called by ``carpool serve`` on SIGTERM/Ctrl-C. Returns ``in_flight`` (when draining
        started), ``finished`` (completed within the grace period) and ``ended`` (cut off).
        """
        return await self.fanout.drain(timeout_s)

    @app.get("/metrics")
    async def metrics(self) -> Response:
        """Every replica's ``carpool:*`` series in the Prometheus text format, and this ingress's
        own (requests it refused); one scrape target for the whole application, see
        ``deploy/prometheus/``. A replica whose call fails is left out of this scrape; where the
        replicas do not all answer within 5 s, or none runs, the scrape holds the ingress's series
        alone (with a warning in the log), never an error."""
        from prometheus_client import CONTENT_TYPE_LATEST

        from router.observability.autoscaler_record import exposition as autoscaler_exposition
        from router.observability.metrics import merge_expositions

        try:
            results = await self.fanout.replica.broadcast("metrics_text").results_async(
                timeout_s=5.0, return_exceptions=True
            )
        except Exception as err:  # Serve's TimeoutError for the whole fan-out, DeploymentUnavailableError
            logger.warning("GET /metrics: the replicas' series are left out of this scrape: %r", err)
            results = []
        texts = [r for r in results if isinstance(r, str)] + [self.metrics.exposition().decode()]
        texts.append(await autoscaler_exposition(self.app_name))  # "" unless the Carpool policy scales this app
        return Response(merge_expositions(texts), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        """The served model, with the replicas' ``max_model_len``, then each LoRA adapter (its
        ``parent`` the served model, its ``root`` its folder, as vLLM lists them)."""
        card = await self._model_card()
        adapters = await self.adapters.adapters(fresh=True)
        return {"object": "list", "data": [card, *self.adapters.cards(adapters, card["max_model_len"])]}

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str) -> dict[str, Any]:
        """One model's card, as in ``GET /v1/models`` (OpenAI's ``models.retrieve``).

        ``GET /v1/models/`` (an empty id) is the list, as ``GET /v1/models``.

        Raises:
            OpenAIError: 404 ``model_not_found`` for any id but the served model's and its adapters'.
        """
        if not model_id:
            return await self.models()
        lora = await self.adapters.lora_request(model_id)
        card = await self._model_card()
        if lora is None:
            return card
        return self.adapters.cards({lora.lora_name: lora.lora_path}, card["max_model_len"])[0]

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, body: LoadLoRAAdapterRequest) -> dict[str, Any]:
        """vLLM's: serve the adapter in ``lora_path`` (inside a ``--lora-dir``) as the model
        ``lora_name``; every ingress serves it from then on. Answers its card (as in
        ``GET /v1/models``) with its ``rank`` and ``target_modules``; 400 naming the reason
        otherwise (:meth:`router.lora.adapters.Adapters.load`)."""
        info = await self.adapters.load(body)
        card = self.adapters.cards({info["name"]: info["path"]}, (await self.replicas.model_info())["max_model_len"])[0]
        return {**card, "rank": info["rank"], "target_modules": info["target_modules"]}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, body: UnloadLoRAAdapterRequest) -> dict[str, Any]:
        """vLLM's: stop serving the adapter ``lora_name`` (requests running with it finish with
        it); 404 ``model_not_found`` for a name that is not a served adapter."""
        path = await self.adapters.unload(body)
        return {"id": body.lora_name, "object": "model", "root": path, "deleted": True}

    async def _model_card(self) -> dict[str, Any]:
        info = await self.replicas.model_info()
        return {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "carpool",
            "root": self.root_model,
            "max_model_len": info["max_model_len"],
        }

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, http: Request):
        """OpenAI's completions: one JSON body, or server-sent events with ``stream``. Latency
        targets come from the headers (``router/request/slo_headers.py``)."""
        slo = latency_targets(http.headers)
        self.fanout.admit()
        prepared = await self._prepared(body, slo, self.checks.check_completion, self.preparer.completion)
        if body.stream:
            streams = await self.fanout.open_streams(prepared)
            events = self.responses.completion_events(prepared, body, self.fanout.deltas(streams), lambda: cancel_all(streams))
            return self._sse(events, streams)
        return self.responses.completion_body(prepared, body, await self.fanout.run_all(prepared))

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, http: Request):
        """OpenAI's chat completions: one JSON body, or server-sent events with ``stream``.
        Latency targets come from the headers (``router/request/slo_headers.py``)."""
        slo = latency_targets(http.headers)
        self.fanout.admit()
        prepared = await self._prepared(body, slo, self.checks.check_chat, self.preparer.chat)
        if body.stream:
            streams = await self.fanout.open_streams(prepared)
            events = self.responses.chat_events(prepared, body, self.fanout.deltas(streams), lambda: cancel_all(streams))
            return self._sse(events, streams)
        return self.responses.chat_body(prepared, body, await self.fanout.run_all(prepared))

    @app.post("/v1/responses")
    async def create_response(self, body: ResponsesRequest, http: Request):
        """OpenAI's Responses API (:mod:`router.responses.api`): the request runs as a chat
        request (the checks, preparation and fan-out of ``/v1/chat/completions``); one JSON
        response object, or typed server-sent events with ``stream``; stored unless ``store`` is
        false. Latency targets come from the headers."""
        slo = latency_targets(http.headers)
        self.fanout.admit()
        turn = await self.responses_api.begin(body)
        try:
            prepared = await self._prepared(turn.chat, slo, self.checks.check_chat, self.preparer.chat)
        except OpenAIError as exc:
            raise responses_error(exc, turn.origins) from None
        prepared.continuation = body.previous_response_id is not None  # routed to its conversation's replica
        turn.model = prepared.model
        try:  # a replica's refusal names the chat field too
            if body.stream:
                streams = await self.fanout.open_streams(prepared)
            else:
                outputs = await self.fanout.run_all(prepared)
        except OpenAIError as exc:
            raise responses_error(exc, turn.origins) from None
        if body.stream:
            chunks = self.responses.chat_events(prepared, turn.chat, self.fanout.deltas(streams), lambda: cancel_all(streams))
            return self._stream(response_events.sse_frames(self.responses_api.events(turn, chunks)), streams)
        chat = self.responses.chat_body(prepared, turn.chat, outputs)
        return await self.responses_api.finish(turn, chat)

    @app.get("/v1/responses/{response_id}", response_class=JSONBody)  # not pydantic's dump_json (the client's strings)
    async def retrieve_response(self, response_id: str, stream: str | None = None) -> dict[str, Any]:
        """A stored response; 404 when it is not stored (never, deleted, expired or evicted),
        400 with ``stream`` (no replay of events)."""
        return await self.responses_api.retrieve(response_id, stream)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(self, response_id: str) -> dict[str, Any]:
        """Forget a stored response: ``{"id", "object": "response", "deleted": true}``; 404 when not stored."""
        return await self.responses_api.delete(response_id)

    @app.post("/v1/embeddings")
    async def embeddings(self, body: EmbeddingRequest) -> dict[str, Any]:
        """OpenAI's embeddings: one replica request per input, run together; the vectors in the
        inputs' order (:mod:`router.embeddings.service`)."""
        self.fanout.admit()
        lora = await self.adapters.lora_request(body.model)
        await self.replicas.check_available()
        jobs = await self.embedder.prepare(body, await self.replicas.model_info(), lora)
        view = await self.replicas.current()
        running = view.running if view.known and view.running > 0 else 1
        wave = running * (self.replicas.seats + self.replicas.waiting)  # what the running replicas hold
        return self.embedder.body(jobs, body, await self.embedder.run(jobs, self.fanout.run_all, wave))

    async def _prepared(self, body: Any, slo: Any, check: Any, prepare: Any) -> Prepared:
        """A completion or chat body (or the chat a Responses turn runs as) checked by ``check``
        (``BodyChecks.check_completion`` or ``check_chat``: its choices and their field), against
        the replicas' availability and capacity, then tokenized by ``prepare`` (the matching
        ``RequestPreparer`` method), with its adapter and latency targets ``slo``. Raises OpenAIError."""
        lora = await self.adapters.lora_request(body.model)
        choices, param = check(body)
        await self.replicas.check_available()
        await self.replicas.check_capacity(choices, param)
        prepared = await prepare(body, await self.replicas.model_info(), lora)
        prepared.slo = slo
        return prepared

    def _sse(self, events: AsyncIterator[dict[str, Any]], streams: list[ChoiceStream]) -> EventStream:
        """The streamed response of ``events`` as ``data:`` frames (:func:`_stream`)."""
        return self._stream(sse_frames(events), streams)

    def _stream(self, frames: AsyncIterator[str], streams: list[ChoiceStream]) -> EventStream:
        """The streamed response of ``frames``, counted in flight while it runs; every replica
        stream of the request is cancelled however it ends."""
        return EventStream(self.fanout.counted(frames), on_close=lambda: cancel_all(streams))
