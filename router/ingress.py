"""The HTTP ingress: an OpenAI-compatible API (FastAPI) deployed on Ray Serve.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``. Each request is validated (pydantic models in :mod:`router.protocol`), its chat
template applied and its prompt tokenized **once, here**; the replicas receive token ids. A request
with ``n`` choices (or several prompts) becomes one replica request per choice, choice ``i`` of a
seeded request using ``seed + i``. Replica outputs arrive through a ``DeploymentHandle`` with
``stream=True`` and leave as one JSON body or as server-sent events ending in ``data: [DONE]``.

Errors are OpenAI's JSON shape ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad
body or parameter, or one past a configured cap (the message names the field), 401 for a missing
or wrong API key, 404 for an unknown model or path, 413 for a body over ``max_request_body_bytes``,
415 for a non-JSON ``Content-Type``, 429 (with ``Retry-After``) when the chosen replica is full,
503 when no replica can serve. A client's mistake never yields a 500. The API key and the body
size are checked by :class:`RequestGuard` before routing; every error response is counted in
``carpool:http_requests_rejected_total``.

A choice whose replica died (or whose engine loop died) before its first delta reached the
client is started again, once, on another replica.

When the HTTP client goes away mid-stream, Serve cancels this handler; the ``finally`` blocks
cancel every replica stream of the request, and each replica aborts its engine request.
"""

# No "from __future__ import annotations": Serve rebuilds the route signatures and must see real types.

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, NamedTuple

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.body_limit import RequestBodyLimitMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from cluster.config import ServeConfig
from replica.errors import EngineDeadError, ReplicaOverloadedError, RequestAbortedError, RequestFailedError
from replica.request import SamplingParams, StepOutput, TokenLogprobs
from router.protocol import ChatCompletionRequest, CompletionRequest, OpenAIError, _SamplingRequest

logger = logging.getLogger(__name__)

NEG_INF_LOGPROB = -9999.0  # JSON has no -inf; vLLM reports this value instead
RETRY_AFTER_S = 1  # the Retry-After of a 429 or 503 (seconds)

app = FastAPI(title="Carpool", description="OpenAI-compatible LLM serving on Ray Serve.")


class _Guard:
    """What the request guard and the error handlers of this process need (see :func:`configure`)."""

    api_key: str | None = None
    max_request_body_bytes: int | None = None
    metrics = None  # replica.metrics.IngressMetrics


_guard = _Guard()


def configure(api_key: str | None, max_request_body_bytes: int | None, metrics) -> None:
    """Set this process's API key, body cap and ingress metrics (``OpenAIIngress`` calls it).

    Serve runs a pickled copy of ``app``, and the ingress class is pickled by value (the module's
    name ``OpenAIIngress`` is Serve's wrapper), so neither ``app.state`` nor a global read in
    ``OpenAIIngress.__init__`` is what the middleware sees; this function, pickled by reference,
    sets the module's own ``_guard``.
    """
    _guard.api_key = api_key
    _guard.max_request_body_bytes = max_request_body_bytes
    _guard.metrics = metrics


# ---- errors ------------------------------------------------------------------------------------
def _error_response(err: OpenAIError) -> JSONResponse:
    """The JSON response of an error (``WWW-Authenticate`` on 401, ``Retry-After`` on 429 and
    503), counted in ``carpool:http_requests_rejected_total``."""
    headers = None
    if err.status_code == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    elif err.status_code in (429, 503):
        headers = {"Retry-After": str(RETRY_AFTER_S)}
    if _guard.metrics is not None:
        _guard.metrics.on_rejected(err.status_code, err.code)
    return JSONResponse(err.body(), status_code=err.status_code, headers=headers)


@app.exception_handler(OpenAIError)
async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
    return _error_response(exc)


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    content_type = request.headers.get("content-type")
    if request.method == "POST" and not (content_type and _is_json(content_type)):
        # FastAPI hands a body without a JSON Content-Type to the model as bytes, which fails.
        got = repr(content_type) if content_type else "none"
        message = f"Content-Type must be application/json, got {got}"
        return _error_response(OpenAIError(message, 415, code="unsupported_media_type"))
    return _error_response(validation_error(exc.errors()))


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 413:
        return _error_response(_body_too_large())
    if exc.status_code == 400 and exc.__cause__ is not None:
        # FastAPI's 400 for a body json.loads raised on with something other than a JSONDecodeError
        # (those come as RequestValidationError); the cause says what.
        return _error_response(_unparsable_body(exc.__cause__))
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return _error_response(OpenAIError(message, exc.status_code))


def _unparsable_body(cause: BaseException) -> OpenAIError:
    """The 400 ``invalid_json`` for a body that ``json.loads`` refused with something other than a
    ``JSONDecodeError``: nesting past the recursion limit (``RecursionError``), an integer past
    Python's 4,300 digits (``ValueError``) or bytes that are not UTF-8 (``UnicodeDecodeError``)."""
    if isinstance(cause, RecursionError):
        reason = "it is nested too deeply"
    elif isinstance(cause, UnicodeDecodeError):
        reason = f"it is not UTF-8 ({cause.reason} at byte {cause.start})"
    elif isinstance(cause, ValueError) and "digits" in str(cause):
        reason = "a number has too many digits (at most 4300)"
    else:
        reason = type(cause).__name__
    return OpenAIError(f"request body is not valid JSON: {reason}", code="invalid_json")


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _body_too_large() -> OpenAIError:
    return OpenAIError(
        f"request body is larger than {_guard.max_request_body_bytes} bytes (max_request_body_bytes)",
        413,
        code="request_too_large",
    )


def validation_error(errors: list[dict[str, Any]]) -> OpenAIError:
    """Turn pydantic/FastAPI validation errors into one 400 naming the first bad field."""
    if not errors:
        return OpenAIError("invalid request body", code="invalid_body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return OpenAIError(f"request body is not valid JSON: {ctx.get('error', first.get('msg'))}", code="invalid_json")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    msg = str(first.get("msg", "invalid value"))
    msg = msg.removeprefix("Value error, ")
    if param is None and first.get("type") in ("missing", "model_attributes_type", "dict_type"):
        return OpenAIError("request body must be a JSON object", code="invalid_body")
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return OpenAIError(f"{param}: {msg}{more}" if param else msg + more, param=param, code="invalid_value")


def _sampling_error(exc: ValueError) -> OpenAIError:
    """A ``ValueError`` from ``SamplingParams``/the engine; its message starts with the field name."""
    message = str(exc)
    first = message.split(" ", 1)[0]
    param = first if first.isidentifier() else None
    return OpenAIError(message, param=param, code="invalid_value")


# ---- auth and body size, before routing -----------------------------------------------------------
def api_key_matches(authorization: str | None, api_key: str) -> bool:
    """True if an ``Authorization`` header value is ``Bearer <api_key>`` (constant-time compare)."""
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


class RequestGuard:
    """ASGI middleware that runs before routing and before any body is read.

    * With an API key, every path but ``/health`` needs ``Authorization: Bearer <api_key>``:
      401 otherwise (unknown paths too, so that they reveal nothing).
    * A body declared larger than ``max_request_body_bytes`` (``Content-Length``) gets 413 at
      once, unread; a body without ``Content-Length`` (chunked) is counted as it arrives
      (Starlette's ``RequestBodyLimitMiddleware``) and refused with 413 when it passes the cap.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
        error = None
        if _guard.api_key and path != "/health" and not api_key_matches(headers.get("authorization"), _guard.api_key):
            error = OpenAIError("missing or invalid API key (Authorization: Bearer ...)", 401, code="invalid_api_key")
        elif _guard.max_request_body_bytes is not None:
            length = headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > _guard.max_request_body_bytes:
                error = _body_too_large()
        if error is not None:
            await _error_response(error)(scope, receive, send)
            return
        if _guard.max_request_body_bytes is None:
            await self.app(scope, receive, send)
            return
        await RequestBodyLimitMiddleware(self.app, _guard.max_request_body_bytes)(scope, receive, send)


app.add_middleware(RequestGuard)


# ---- one choice's accumulated output -------------------------------------------------------------
class _Choice:
    __slots__ = ("index", "prompt_index", "text", "token_ids", "logprobs", "finish_reason", "stop_reason", "num_output_tokens")

    def __init__(self, index: int, prompt_index: int) -> None:
        self.index = index
        self.prompt_index = prompt_index
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_output_tokens = 0

    def add(self, delta: StepOutput) -> None:
        self.text.append(delta.new_text)
        self.token_ids.extend(delta.new_token_ids)
        if delta.new_logprobs:
            self.logprobs.extend(delta.new_logprobs)
        self.num_output_tokens = delta.num_output_tokens
        if delta.finished:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason


class _Prepared:
    """A validated request: prompts as token ids and one SamplingParams per choice."""

    def __init__(self, request_id: str, model: str, prompts: list[list[int]], prompt_texts: list[str], params: list[list[SamplingParams]]):
        self.request_id = request_id
        self.model = model
        self.prompts = prompts
        self.prompt_texts = prompt_texts
        self.params = params  # params[prompt_index][j]
        self.created = int(time.time())

    def jobs(self) -> list[tuple[int, int, list[int], SamplingParams]]:
        """(choice index, prompt index, prompt ids, params); choice index = prompt_index * n + j."""
        out = []
        for p, (ids, per_prompt) in enumerate(zip(self.prompts, self.params)):
            for j, params in enumerate(per_prompt):
                out.append((p * len(per_prompt) + j, p, ids, params))
        return out

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


class _StreamError(Exception):
    def __init__(self, error: OpenAIError) -> None:
        super().__init__(error.message)
        self.error = error


def _finite(value: float) -> float:
    return value if value > NEG_INF_LOGPROB else NEG_INF_LOGPROB


def _replica_error(exc: BaseException) -> OpenAIError:
    """Map an exception raised while streaming from a replica to an OpenAI error.

    ``ValueError`` (the engine refused the request) → 400; a full replica
    (:class:`~replica.errors.ReplicaOverloadedError`) or a full handle queue (Serve's
    ``BackPressureError``) → 429 with ``Retry-After``; an internal error of the engine that ended
    this request alone (``RequestFailedError``) → 500; anything else (the replica process died,
    its engine loop stopped, the server ended the request while shutting down) → 503, so that
    clients retry.
    """
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, (ReplicaOverloadedError, BackPressureError)):
        return OpenAIError(
            "the server is at capacity (every replica's waiting queue is full); retry after a moment",
            429,
            type="overloaded_error",
            code="overloaded",
        )
    cause = getattr(exc, "cause", None)  # a RayTaskError carries the replica's own exception
    if isinstance(exc, ValueError):
        return _sampling_error(cause if isinstance(cause, ValueError) else exc)
    original = cause if isinstance(cause, BaseException) else exc
    logger.warning("replica request failed: %r", original)
    if isinstance(original, RequestFailedError):
        return OpenAIError(str(original), 500, type="internal_server_error", code="internal_error")
    if isinstance(original, (RequestAbortedError, EngineDeadError)):
        detail = str(original)
    else:  # e.g. ray.exceptions.ActorDiedError: the replica process is gone
        detail = f"the replica serving this request failed ({type(original).__name__}); retry"
    return OpenAIError(detail, 503, type="service_unavailable_error", code="unavailable")


class _ChoiceStream:
    """One choice's replica stream (``LLMReplica.generate`` through the streaming handle), with
    what it takes to start the choice again on another replica (:meth:`OpenAIIngress._restart`).

    Attributes:
        index: the choice index (``prompt_index * n + j``).
        request_id: the replica request id (``-retry`` appended for the second attempt).
        prompt: the prompt's token ids.
        params: the choice's sampling parameters.
        gen: the current ``DeploymentResponseGenerator``.
        retried: the choice was already started again once.
    """

    __slots__ = ("index", "request_id", "prompt", "params", "gen", "retried")

    def __init__(self, index: int, request_id: str, prompt: list[int], params: SamplingParams, gen: Any) -> None:
        self.index = index
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.gen = gen
        self.retried = False

    def start_over(self, exc: BaseException) -> None:
        """Mark this choice as started again (once) after ``exc``: a new request id, logged."""
        logger.warning(
            "replica gone before the first token of %s (%r): starting it again on another replica", self.request_id, exc
        )
        self.retried = True
        self.request_id += "-retry"


class _EventStream(StreamingResponse):
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


def _ended_error() -> OpenAIError:
    """A request ended because the server shuts down and its grace period is over."""
    return OpenAIError("the server is shutting down", 503, type="service_unavailable_error", code="unavailable")


def _cancel(response: Any) -> None:
    """Cancel a handle call (a ``DeploymentResponse`` or ``DeploymentResponseGenerator``); a no-op
    for a finished one.

    Serve's ``cancel()`` raises the error of a call that never reached a replica (e.g.
    ``BackPressureError`` when the handle's queue was full): there is nothing to cancel then, and
    that error has already been answered (429), so it must not escape a cleanup path and reach
    Serve's own plain-text handler.
    """
    try:
        response.cancel()
    except Exception:
        pass


def _cancel_all(streams: list[_ChoiceStream]) -> None:
    for s in streams:
        _cancel(s.gen)


def _replica_gone(exc: BaseException) -> bool:
    """True for the failures after which another replica may serve the request from scratch: the
    replica process died or cannot be reached (Ray's ``ActorDiedError``/``ActorUnavailableError``,
    both ``RayActorError``), or its engine loop died (:class:`~replica.errors.EngineDeadError`),
    raised as is or inside a ``RayTaskError``."""
    gone = (RayActorError, EngineDeadError)
    return isinstance(exc, gone) or isinstance(getattr(exc, "cause", None), gone)


def _stream_event(
    prepared: "_Prepared", kind: str, choices: list[dict[str, Any]], usage: dict[str, int] | None
) -> dict[str, Any]:
    """One SSE event of a streamed response (``kind``: ``text_completion`` or ``chat.completion.chunk``)."""
    event = {"id": prepared.request_id, "object": kind, "created": prepared.created, "model": prepared.model, "choices": choices}
    if usage is not None:
        event["usage"] = usage
    return event


VIEW_TTL_S = 1.0
"""How long the ingress trusts its last look at the replica deployment (seconds): its running
replicas for ``/health``, and its replica bound for :meth:`OpenAIIngress._check_capacity`."""


VIEW_TIMEOUT_S = 3.0
"""How long one look at the deployment may wait for Serve's controller (seconds); then the view is
unknown (``/health`` answers 503, nothing is refused)."""


class _ReplicaView(NamedTuple):
    """The replica deployment as Serve's controller reported it (:func:`_read_replica_view`)."""

    checked: float  # time.monotonic() of the look
    known: bool  # False: the controller did not answer; the fields below are then placeholders
    running: int  # replicas in state RUNNING
    status: str  # Serve's deployment status: HEALTHY, UPDATING, UPSCALING, DOWNSCALING, UNHEALTHY, ...
    max_replicas: int | None  # autoscaling max_replicas, else num_replicas; None if not given
    detail: str  # for /health


def _read_replica_view(app_name: str, deployment_name: str) -> _ReplicaView:
    """One look at a deployment through Serve's controller (a blocking call: run it in a thread).

    Reads the controller's instance details (what ``serve.status()`` reads, in the format of
    Serve's ``ServeInstanceDetails``), which also carry the deployment's current config, so that
    replica counts set by a Serve config file's ``deployments`` entries count.

    Raises:
        KeyError: the application or deployment does not exist (yet); any error of the call.
        ray.exceptions.GetTimeoutError: the controller did not answer within
            :data:`VIEW_TIMEOUT_S` (``get_serve_details()`` has no timeout: a stalled controller
            would hold ``/health`` and the view's renewal forever).
    """
    import ray
    from ray.serve.context import _get_global_client

    controller = _get_global_client()._controller
    details = ray.get(controller.get_serve_instance_details.remote(), timeout=VIEW_TIMEOUT_S)
    deployment = details["applications"][app_name]["deployments"][deployment_name]
    running = sum(1 for r in deployment.get("replicas", ()) if str(r.get("state")).rsplit(".", 1)[-1] == "RUNNING")
    status = str(deployment["status"]).rsplit(".", 1)[-1]
    config = deployment.get("deployment_config") or {}
    scaling = config.get("autoscaling_config")
    most = scaling.get("max_replicas") if scaling else config.get("num_replicas")
    return _ReplicaView(
        time.monotonic(), True, running, status, most if isinstance(most, int) else None,
        f"replicas: {status} ({running} running)",
    )


SERVING_STATUSES = ("HEALTHY", "UPSCALING", "DOWNSCALING")
"""Serve deployment statuses of a deployment that is where it should be (UPSCALING/DOWNSCALING:
autoscaled, its running replicas serve meanwhile)."""


def _unavailable(view: _ReplicaView) -> bool:
    """No replica can serve: none running, and the deployment is not merely scaled to zero."""
    return view.known and view.running == 0 and view.status not in SERVING_STATUSES


@serve.ingress(app)
class OpenAIIngress:
    """Serve deployment body (options are set in :func:`cluster.app.build_app`).

    Args:
        replica: handle of the ``LLMReplica`` deployment.
        config: the :class:`~cluster.config.ServeConfig` as a dict.
    """

    def __init__(self, replica: DeploymentHandle, config: dict[str, Any]) -> None:
        from replica.model_loader import load_tokenizer, resolve_model_path

        self.config = ServeConfig(**config)
        self.model_name = self.config.model_name
        self.replica = replica
        self.stream_handle = replica.options(stream=True)
        engine = self.config.engine
        self.tokenizer = load_tokenizer(resolve_model_path(engine.tokenizer or engine.model, weights=False))
        self._info: dict[str, Any] | None = None
        # Characters of the longest token (byte-level BPE and SentencePiece pieces decode to at
        # most as many characters as their vocabulary strings have); see _check_prompt_chars.
        self._max_token_chars = max(1, max(len(t) for t in self.tokenizer.get_vocab()))
        self._token_text: dict[int, str] = {}
        from replica.deployment import _replica_id
        from replica.metrics import IngressMetrics

        self.metrics = IngressMetrics(model_name=self.model_name, replica=_replica_id())
        configure(self.config.api_key, self.config.max_request_body_bytes, self.metrics)
        self._view: _ReplicaView | None = None  # the replica deployment, see _replica_view
        self._view_task: asyncio.Task | None = None  # renewing self._view
        self._ready_once = False  # every replica was up at least once (start-up is over)
        self._draining = False  # shutting down: new generation requests get 503
        self._ended = asyncio.Event()  # shutting down and the grace period is over
        self._inflight = 0  # generation requests being answered (streams until their last event)
        self._opening = 0  # streamed requests waiting for their replicas' admission (_open_streams)

    # ---- endpoints ---------------------------------------------------------------------------
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health(self) -> JSONResponse:
        """200 once every replica has loaded its model, and from then on while at least one
        replica is running (a replaced replica leaves the others serving); 503 before start-up
        completes, while no replica can serve, and while the server shuts down."""
        if self._draining:
            return JSONResponse({"status": "shutting_down", "detail": "the server is shutting down"}, status_code=503)
        ok, detail = await self._replicas_healthy()
        return JSONResponse({"status": "ok" if ok else "unavailable", "detail": detail}, status_code=200 if ok else 503)

    async def drain(self, timeout_s: float) -> dict[str, int]:
        """Stop admitting (new generation requests get 503 ``shutting_down``), wait up to
        ``timeout_s`` seconds for the requests in flight to finish, then end the rest on every
        replica (their clients get a 503 error: JSON, or an error event and ``[DONE]``).

        Called by ``carpool serve`` on SIGTERM/Ctrl-C. Returns ``in_flight`` (when draining
        started), ``finished`` (completed within the grace period) and ``ended`` (cut off).
        """
        self._draining = True
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

    async def _unless_ended(self, awaitable: Any) -> Any:
        """Await a handle call (an admission or a ``generate_all`` result) unless the shutdown
        grace period ends first (:meth:`drain`): then raise 503 (the caller cancels the call).
        A call in Serve's queue waits for a replica that may not come before the server stops."""
        if self._ended.is_set():
            raise _ended_error()
        call = asyncio.ensure_future(awaitable)
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

    def _admit(self) -> None:
        if self._draining:
            raise OpenAIError("the server is shutting down", 503, type="service_unavailable_error", code="shutting_down")

    @app.get("/metrics")
    async def metrics(self) -> Response:
        """Every replica's ``carpool:*`` series in the Prometheus text format, and this ingress's
        own (requests it refused); one scrape target for the whole application, see
        ``deploy/prometheus/``. A replica that does not answer within 5 s is left out of this scrape."""
        from prometheus_client import CONTENT_TYPE_LATEST

        from replica.metrics import merge_expositions

        results = await self.replica.broadcast("metrics_text").results_async(timeout_s=5.0, return_exceptions=True)
        texts = [r for r in results if isinstance(r, str)] + [self.metrics.exposition().decode()]
        return Response(merge_expositions(texts), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        info = await self._model_info()
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "carpool",
                    "root": self.config.engine.model,
                    "max_model_len": info["max_model_len"],
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest):
        self._admit()
        self._check_common(body)
        if body.suffix:
            raise OpenAIError("suffix is not supported", param="suffix", code="unsupported")
        if body.best_of is not None and body.best_of != body.n:
            raise OpenAIError("best_of other than n is not supported", param="best_of", code="unsupported")
        if body.echo and body.logprobs is not None:
            raise OpenAIError("echo with logprobs (prompt logprobs) is not supported", param="echo", code="unsupported")
        caps = self.config
        if len(body.prompt) > caps.max_prompts_per_request:
            raise OpenAIError(
                f"prompt: at most {caps.max_prompts_per_request} prompts per request, got {len(body.prompt)}",
                param="prompt", code="invalid_value",
            )
        fanout_param = "prompt" if len(body.prompt) > 1 else "n"
        self._check_fanout(len(body.prompt) * body.n, fanout_param)
        if body.logprobs is not None and body.logprobs > caps.max_logprobs:
            raise OpenAIError(f"logprobs: must be at most {caps.max_logprobs}, got {body.logprobs}", param="logprobs", code="invalid_value")
        await self._check_available()
        await self._check_capacity(len(body.prompt) * body.n, fanout_param)
        info = await self._model_info()
        prompts, texts = [], []
        for i, p in enumerate(body.prompt):
            param = "prompt" if len(body.prompt) == 1 else f"prompt.{i}"
            if isinstance(p, str):
                self._check_prompt_chars(p, info, param)
                ids = await asyncio.to_thread(self._encode, p, param, True)
                texts.append(p)
            else:
                ids = list(p)
                texts.append(self.tokenizer.decode(ids) if body.echo else "")
            self._check_prompt(ids, info, param)
            prompts.append(ids)
        prepared = self._prepare("cmpl", body, prompts, texts, body.max_tokens, body.logprobs, info)
        if body.stream:
            streams = await self._open_streams(prepared)
            return self._sse(self._completion_stream(prepared, body, streams), streams)
        choices = await self._run_all(prepared)
        return self._completion_body(prepared, body, choices)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest):
        self._admit()
        self._check_common(body)
        if body.tools:
            raise OpenAIError("tools are not supported", param="tools", code="unsupported")
        if body.response_format and body.response_format.get("type", "text") != "text":
            raise OpenAIError("only response_format {'type': 'text'} is supported", param="response_format", code="unsupported")
        if body.top_logprobs is not None and not body.logprobs:
            raise OpenAIError("top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
        if body.top_logprobs is not None and body.top_logprobs > self.config.max_logprobs:
            raise OpenAIError(
                f"top_logprobs: must be at most {self.config.max_logprobs}, got {body.top_logprobs}",
                param="top_logprobs", code="invalid_value",
            )
        self._check_fanout(body.n, "n")
        await self._check_available()
        await self._check_capacity(body.n, "n")
        info = await self._model_info()
        ids = await asyncio.to_thread(self._apply_chat_template, body, info)
        self._check_prompt(ids, info, "messages")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        prepared = self._prepare("chatcmpl", body, [ids], [""], max_tokens, logprobs, info, param)
        if body.stream:
            streams = await self._open_streams(prepared)
            return self._sse(self._chat_stream(prepared, body, streams), streams)
        choices = await self._run_all(prepared)
        return self._chat_body(prepared, body, choices)

    # ---- validation and preparation ----------------------------------------------------------
    def _check_common(self, body: _SamplingRequest) -> None:
        if body.model is not None and body.model != self.model_name:
            raise OpenAIError(f"The model `{body.model}` does not exist.", 404, param="model", code="model_not_found")
        if body.n > self.config.max_n:
            raise OpenAIError(f"n: must be at most {self.config.max_n}, got {body.n}", param="n", code="invalid_value")
        if body.logit_bias:
            raise OpenAIError("logit_bias is not supported", param="logit_bias", code="unsupported")
        if body.stream_options is not None and not body.stream:
            raise OpenAIError("stream_options is only allowed when stream is true", param="stream_options", code="invalid_value")
        stops = body.stop or []
        if len(stops) > self.config.max_stop_sequences:
            raise OpenAIError(
                f"stop: at most {self.config.max_stop_sequences} stop sequences, got {len(stops)}",
                param="stop", code="invalid_value",
            )
        longest = max((len(s) for s in stops), default=0)
        if longest > self.config.max_stop_sequence_length:
            raise OpenAIError(
                f"stop: a stop sequence has at most {self.config.max_stop_sequence_length} characters, got {longest}",
                param="stop", code="invalid_value",
            )

    def _check_fanout(self, choices: int, param: str) -> None:
        """Prompts × ``n`` (one replica request each) must not pass ``max_choices_per_request``."""
        if choices > self.config.max_choices_per_request:
            raise OpenAIError(
                f"{param}: the request asks for {choices} choices (prompts x n), at most "
                f"{self.config.max_choices_per_request} are allowed",
                param=param, code="invalid_value",
            )

    def _check_prompt(self, ids: list[int], info: dict[str, Any], param: str) -> None:
        vocab = info["vocab_size"]
        for t in ids:
            if not 0 <= t < vocab:
                raise OpenAIError(f"{param}: token id {t} is outside the vocabulary [0, {vocab})", param=param, code="invalid_value")
        if len(ids) >= info["max_model_len"]:
            raise OpenAIError(
                f"{param}: this model's maximum context length is {info['max_model_len']} tokens; the prompt "
                f"has {len(ids)} tokens, which leaves no room for output. Please shorten it.",
                param=param,
                code="context_length_exceeded",
            )

    def _check_prompt_chars(self, text: str, info: dict[str, Any], param: str) -> None:
        """Refuse, without tokenizing it, a text that must be longer than ``max_model_len`` tokens:
        no token decodes to more than ``self._max_token_chars`` characters, so a text of more than
        ``max_model_len × _max_token_chars`` characters has more than ``max_model_len`` tokens.
        Keeps a client's megabytes of prompt from holding the tokenizer for seconds."""
        limit = info["max_model_len"] * self._max_token_chars
        if len(text) > limit:
            raise OpenAIError(
                f"{param}: {len(text)} characters are more than the {info['max_model_len']} tokens "
                f"this model accepts can hold (at most {limit} characters)",
                param=param,
                code="context_length_exceeded",
            )

    def _apply_chat_template(self, body: ChatCompletionRequest, info: dict[str, Any]) -> list[int]:
        """Render the model's chat template over ``body.messages`` and tokenize; runs in a worker
        thread (``asyncio.to_thread``) so that the event loop keeps serving other requests.

        Raises:
            OpenAIError: 400 if the client sends its own ``chat_template`` (a template is code:
                the server runs only the model's), the template fails, or the text is too long.
        """
        kwargs = dict(body.chat_template_kwargs or {})
        if "chat_template" in kwargs:
            raise OpenAIError(
                "chat_template_kwargs.chat_template is not accepted: the server applies the model's own chat template",
                param="chat_template_kwargs", code="unsupported",
            )
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        for m in messages:
            m.setdefault("content", "")
        for i, m in enumerate(messages):
            content = m["content"]
            if isinstance(content, str):
                self._check_prompt_chars(content, info, f"messages.{i}.content")
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
                continue_final_message=body.continue_final_message,
                **kwargs,
            )
        except Exception as exc:  # jinja errors, e.g. a role the template rejects
            raise OpenAIError(f"messages: the chat template failed: {exc}", param="messages", code="invalid_value") from None
        self._check_prompt_chars(text, info, "messages")
        return self._encode(text, "messages", add_special_tokens=False)

    def _encode(self, text: str, param: str, add_special_tokens: bool) -> list[int]:
        """Tokenize, turning a text the tokenizer refuses (e.g. a lone UTF-16 surrogate) into a 400."""
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except Exception as exc:
            raise OpenAIError(f"{param}: the text cannot be tokenized: {exc}", param=param, code="invalid_value") from None

    def _prepare(
        self,
        kind: str,
        body: _SamplingRequest,
        prompts: list[list[int]],
        texts: list[str],
        max_tokens: int | None,
        logprobs: int | None,
        info: dict[str, Any],
        max_tokens_param: str = "max_tokens",
    ) -> _Prepared:
        limit = info["max_model_len"]
        params: list[list[SamplingParams]] = []
        for i, ids in enumerate(prompts):
            room = limit - len(ids)
            if max_tokens is None:
                tokens = room
            elif len(ids) + max_tokens > limit:
                raise OpenAIError(
                    f"{max_tokens_param}: this model's maximum context length is {limit} tokens. However, you requested "
                    f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} for the "
                    f"completion). Please reduce the prompt or {max_tokens_param}.",
                    param=max_tokens_param,
                    code="context_length_exceeded",
                )
            else:
                tokens = max_tokens
            per_prompt = []
            for j in range(body.n):
                try:
                    per_prompt.append(
                        SamplingParams(
                            n=1,
                            max_tokens=tokens,
                            min_tokens=min(body.min_tokens, tokens),
                            temperature=1.0 if body.temperature is None else body.temperature,
                            top_p=1.0 if body.top_p is None else body.top_p,
                            top_k=0 if body.top_k is None else body.top_k,
                            min_p=0.0 if body.min_p is None else body.min_p,
                            presence_penalty=body.presence_penalty or 0.0,
                            frequency_penalty=body.frequency_penalty or 0.0,
                            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                            seed=None if body.seed is None else body.seed + j,
                            stop=list(body.stop or []),
                            stop_token_ids=list(body.stop_token_ids or []),
                            ignore_eos=body.ignore_eos,
                            logprobs=logprobs,
                            include_stop_str_in_output=body.include_stop_str_in_output,
                            skip_special_tokens=body.skip_special_tokens,
                        )
                    )
                except ValueError as exc:
                    raise _sampling_error(exc) from None
            params.append(per_prompt)
        request_id = f"{kind}-{uuid.uuid4().hex}"
        return _Prepared(request_id, self.model_name, prompts, texts, params)

    async def _model_info(self) -> dict[str, Any]:
        """Limits from a replica (``max_model_len`` depends on its KV pool); fetched once. Before
        that, while no replica can serve, a 503 at once (:meth:`_check_available`) instead of a
        wait in Serve's queue."""
        if self._info is None:
            await self._check_available()
            try:
                self._info = await self.replica.model_info.remote()
            except Exception as exc:  # a full handle queue → 429, no replica → 503
                raise _replica_error(exc) from None
        return self._info

    async def _replica_view(self, fresh: bool = False) -> "_ReplicaView":
        """The ``LLMReplica`` deployment as Serve's controller last reported it.

        A view younger than :data:`VIEW_TTL_S` is returned as is. An older one is renewed by one
        controller call in a worker thread, shared by every caller that asks meanwhile: the
        caller waits for it if ``fresh`` or if there is no view yet, and otherwise gets the last
        view at once while the new one is taken in the background. So a request adds no round
        trip while the deployment serves.
        """
        view = self._view
        if view is not None and time.monotonic() - view.checked < VIEW_TTL_S:
            return view
        if self._view_task is None:
            self._view_task = asyncio.create_task(self._renew_view())
        if view is None or fresh:
            return await asyncio.shield(self._view_task)
        return view

    async def _renew_view(self) -> "_ReplicaView":
        try:
            view = await asyncio.to_thread(_read_replica_view, serve.get_replica_context().app_name, self.replica.deployment_name)
        except Exception as exc:  # the controller did not answer: nothing is known
            view = _ReplicaView(time.monotonic(), False, 0, "UNKNOWN", None, f"status unavailable: {exc!r}")
        finally:
            self._view_task = None
        self._view = view
        return view

    async def _replicas_healthy(self) -> tuple[bool, str]:
        """``/health``: (ok, detail) from a view at most :data:`VIEW_TTL_S` old."""
        view = await self._replica_view(fresh=True)
        if not view.known:
            return False, view.detail
        serving = view.status in SERVING_STATUSES
        self._ready_once = self._ready_once or (serving and view.running > 0)
        # After start-up, one running replica is enough to serve while Serve replaces others.
        return view.running > 0 and (serving or self._ready_once), view.detail

    async def _check_available(self) -> None:
        """Refuse a generation request at once while no replica can serve: the replica deployment
        has no running replica and Serve does not report it as healthy or scaling (its replicas
        died or failed their health checks and are being replaced, or it is still starting).
        Otherwise the request would wait in the handle's queue until a replica is back.

        A deployment at zero replicas that Serve reports healthy or scaling (autoscaling with
        ``min_replicas: 0``) is not refused: its request starts a replica. Uses
        :meth:`_replica_view`; a view that says "unavailable" is renewed first if it is older than
        :data:`VIEW_TTL_S`, so only a current view refuses. An unknown view refuses nothing.

        Raises:
            OpenAIError: 503 ``unavailable`` (with ``Retry-After``).
        """
        view = await self._replica_view()
        if _unavailable(view):
            view = await self._replica_view(fresh=True)
        if _unavailable(view):
            raise OpenAIError(
                f"no replica can serve right now ({view.detail}); retry in a moment",
                503, type="service_unavailable_error", code="unavailable",
            )

    async def _check_capacity(self, choices: int, param: str) -> None:
        """Refuse with 400 a request of more choices (prompts x ``n``, one replica request each)
        than the whole deployment can ever hold at once: its most replicas (autoscaling
        ``max_replicas``, else ``num_replicas``, as Serve's controller holds them, so a Serve
        config's overrides count) x (``max_num_seqs`` + ``max_waiting_requests``). Such a request
        would otherwise draw a 429 on every retry.

        A request that one replica can hold costs nothing here; for a larger one the replica
        count comes from :meth:`_replica_view`. If it is unknown nothing is refused (the replicas
        then answer 429 as usual).

        Raises:
            OpenAIError: 400 ``invalid_value`` naming ``param`` (``n``, or ``prompt`` for a list
                of prompts), with the limit in the message.
        """
        seats, waiting = self.config.engine.max_num_seqs, self.config.max_waiting_requests
        if choices <= seats + waiting:
            return
        replicas = (await self._replica_view()).max_replicas
        if replicas is None:
            return
        capacity = replicas * (seats + waiting)
        if choices > capacity:
            raise OpenAIError(
                f"{param}: the request asks for {choices} choices (prompts x n), more than the "
                f"{capacity} requests this server can ever hold at once ({replicas} replicas x "
                f"({seats} max_num_seqs + {waiting} max_waiting_requests)); a retry cannot succeed, "
                f"ask for at most {capacity}",
                param=param, code="invalid_value",
            )

    # ---- running on the replicas -------------------------------------------------------------
    async def _open_streams(self, prepared: _Prepared) -> list[_ChoiceStream]:
        """Fan the request out (one replica stream per choice) and wait until every replica has
        admitted its part, so that a refusal is an HTTP status (429 when a replica is full), not
        an error event in a stream that has already begun. A choice whose replica is gone before
        admitting it is started again once elsewhere (:meth:`_may_retry`).

        Raises :class:`OpenAIError`; then, or if this call is cancelled, every stream is cancelled.
        """
        streams = []
        for index, _, ids, params in prepared.jobs():
            rid = f"{prepared.request_id}-{index}"
            streams.append(_ChoiceStream(index, rid, ids, params, self.stream_handle.generate.remote(rid, ids, params, True)))
        self._opening += 1
        try:
            for s in streams:
                try:
                    await self._unless_ended(s.gen.__anext__())  # the replica's admission (None)
                except Exception as exc:
                    if not await self._may_retry(s, exc):
                        raise
                    await self._restart(s, exc)
        except BaseException as exc:
            _cancel_all(streams)
            if isinstance(exc, Exception):
                raise _replica_error(exc) from None
            raise
        finally:
            self._opening -= 1
        return streams

    async def _may_retry(self, s: _ChoiceStream, exc: BaseException) -> bool:
        """Whether a choice that failed with ``exc`` before its first delta may start again:
        its replica is gone (:func:`_replica_gone`), it has not been retried yet, the server is
        not shutting down, and some replica can serve (otherwise the retry would only wait in
        Serve's queue)."""
        if s.retried or self._draining or not _replica_gone(exc):
            return False
        return not _unavailable(await self._replica_view())

    async def _restart(self, s: _ChoiceStream, exc: BaseException) -> None:
        """Start choice ``s`` again (the second and last time) and wait for its admission. Serve's
        router has marked the dead replica as such, so another one takes it.

        Raises what the new admission raises."""
        _cancel(s.gen)
        s.start_over(exc)
        s.gen = self.stream_handle.generate.remote(s.request_id, s.prompt, s.params, True)
        await self._unless_ended(s.gen.__anext__())

    async def _deltas(self, s: _ChoiceStream) -> AsyncIterator[StepOutput]:
        """The deltas of one admitted choice. If its replica is gone before the first delta (so
        nothing of this choice has reached the client), the choice starts again once on another
        replica and its deltas follow from there."""
        started = False
        while True:
            try:
                async for delta in s.gen:
                    started = True
                    yield delta
                return
            except Exception as exc:
                if started or not await self._may_retry(s, exc):
                    raise
                await self._restart(s, exc)

    async def _stream_choices(self, streams: list[_ChoiceStream]) -> AsyncIterator[tuple[int, StepOutput]]:
        """Yield ``(choice index, delta)`` from the admitted streams (:meth:`_open_streams`) as
        deltas arrive (:meth:`_deltas`). Closing this generator cancels every replica request
        still running."""
        if len(streams) == 1:
            s = streams[0]
            try:
                async with aclosing(self._deltas(s)) as deltas:
                    async for delta in deltas:
                        yield s.index, delta
            finally:
                _cancel(s.gen)
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(s: _ChoiceStream) -> None:
            try:
                async with aclosing(self._deltas(s)) as deltas:
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
            _cancel_all(streams)

    async def _run_all(self, prepared: _Prepared) -> list[_Choice]:
        """Non-streaming: one ``generate_all`` call per choice (one message back, not one per
        token). A choice whose replica is gone is started again once on another replica (nothing
        of it has reached the client). If this handler is cancelled (client gone), or one choice
        fails, the calls are cancelled too."""
        jobs = prepared.jobs()

        async def run(index: int, ids: list[int], params: SamplingParams) -> StepOutput:
            s = _ChoiceStream(index, f"{prepared.request_id}-{index}", ids, params, None)
            while True:
                s.gen = self.replica.generate_all.remote(s.request_id, ids, params)
                try:
                    return await self._unless_ended(s.gen)
                except Exception as exc:
                    if not await self._may_retry(s, exc):
                        raise
                    s.start_over(exc)
                finally:
                    _cancel(s.gen)

        self._inflight += 1
        tasks = [asyncio.create_task(run(index, ids, params)) for index, _, ids, params in jobs]
        try:
            outputs = await asyncio.gather(*tasks)
        except Exception as exc:
            raise _replica_error(exc) from None
        finally:
            self._inflight -= 1
            for task in tasks:
                task.cancel()  # no-op for the finished ones
        choices = []
        for (index, p, _, _), output in zip(jobs, outputs):
            choice = _Choice(index, p)
            choice.add(output)
            choices.append(choice)
        return choices

    # ---- response bodies ---------------------------------------------------------------------
    def _usage(self, prepared: _Prepared, choices) -> dict[str, int]:
        completion = sum(c.num_output_tokens for c in choices)
        return {
            "prompt_tokens": prepared.num_prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prepared.num_prompt_tokens + completion,
        }

    def _token_str(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            if len(self._token_text) < 200_000:
                self._token_text[token_id] = text
        return text

    def _completion_logprobs(self, logprobs: list[TokenLogprobs], offset: int) -> dict[str, Any]:
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for lp in logprobs:
            token = self._token_str(lp.token_id)
            tokens.append(token)
            token_logprobs.append(_finite(lp.logprob))
            top = {self._token_str(t): _finite(v) for t, v in lp.top}
            top.setdefault(token, _finite(lp.logprob))
            tops.append(top)
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}

    def _chat_logprobs(self, logprobs: list[TokenLogprobs]) -> list[dict[str, Any]]:
        def entry(token_id: int, value: float) -> dict[str, Any]:
            token = self._token_str(token_id)
            return {"token": token, "logprob": _finite(value), "bytes": list(token.encode("utf-8"))}

        return [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in logprobs
        ]

    def _completion_body(self, prepared: _Prepared, body: CompletionRequest, choices: list[_Choice]) -> dict[str, Any]:
        out = []
        for c in choices:
            prefix = prepared.prompt_texts[c.prompt_index] if body.echo else ""
            text = "".join(c.text)
            out.append(
                {
                    "index": c.index,
                    "text": prefix + text,
                    "logprobs": self._completion_logprobs(c.logprobs, len(prefix)) if body.logprobs is not None else None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        return {
            "id": prepared.request_id,
            "object": "text_completion",
            "created": prepared.created,
            "model": prepared.model,
            "choices": out,
            "usage": self._usage(prepared, choices),
        }

    def _chat_body(self, prepared: _Prepared, body: ChatCompletionRequest, choices: list[_Choice]) -> dict[str, Any]:
        out = []
        for c in choices:
            out.append(
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": "".join(c.text)},
                    "logprobs": {"content": self._chat_logprobs(c.logprobs)} if body.logprobs else None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        return {
            "id": prepared.request_id,
            "object": "chat.completion",
            "created": prepared.created,
            "model": prepared.model,
            "choices": out,
            "usage": self._usage(prepared, choices),
        }

    # ---- streaming -----------------------------------------------------------------------------
    def _sse(self, events: AsyncIterator[dict[str, Any]], streams: list[_ChoiceStream]) -> StreamingResponse:
        async def frames() -> AsyncIterator[str]:
            self._inflight += 1  # counted from the first frame to the last (or the disconnect)
            try:
                async for event in events:
                    yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                self._inflight -= 1

        return _EventStream(frames(), on_close=lambda: _cancel_all(streams))

    async def _guarded(self, streams: list[_ChoiceStream]) -> AsyncIterator[tuple[int, StepOutput]]:
        """Like ``_stream_choices``, but replica errors become one OpenAI error event."""
        try:
            async for item in self._stream_choices(streams):
                yield item
        except Exception as exc:
            raise _StreamError(_replica_error(exc)) from None

    async def _completion_stream(
        self, prepared: _Prepared, body: CompletionRequest, streams: list[_ChoiceStream]
    ) -> AsyncIterator[dict[str, Any]]:
        def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> dict[str, Any]:
            return _stream_event(prepared, "text_completion", choices, usage)

        choices = {index: _Choice(index, p) for index, p, _, _ in prepared.jobs()}
        offsets = {index: 0 for index in choices}
        try:
            if body.echo:
                echoed = []
                for index, c in choices.items():
                    prefix = prepared.prompt_texts[c.prompt_index]
                    offsets[index] = len(prefix)
                    echoed.append({"index": index, "text": prefix, "logprobs": None, "finish_reason": None})
                yield chunk(echoed)
            async for index, delta in self._guarded(streams):
                c = choices[index]
                c.add(delta)
                if not delta.new_text and not delta.finished and not (body.logprobs is not None and delta.new_logprobs):
                    continue
                logprobs = None
                if body.logprobs is not None:
                    logprobs = self._completion_logprobs(delta.new_logprobs or [], offsets[index])
                    offsets[index] += sum(len(t) for t in logprobs["tokens"])
                yield chunk([{
                    "index": index,
                    "text": delta.new_text,
                    "logprobs": logprobs,
                    "finish_reason": delta.finish_reason if delta.finished else None,
                    "stop_reason": delta.stop_reason if delta.finished else None,
                }])
            if body.stream_options and body.stream_options.include_usage:
                yield chunk([], self._usage(prepared, choices.values()))
        except _StreamError as exc:
            yield exc.error.body()
        finally:  # closed early (client gone): no replica request outlives the response
            _cancel_all(streams)

    async def _chat_stream(
        self, prepared: _Prepared, body: ChatCompletionRequest, streams: list[_ChoiceStream]
    ) -> AsyncIterator[dict[str, Any]]:
        def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> dict[str, Any]:
            return _stream_event(prepared, "chat.completion.chunk", choices, usage)

        choices = {index: _Choice(index, p) for index, p, _, _ in prepared.jobs()}
        try:
            for index in choices:
                yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
            async for index, delta in self._guarded(streams):
                choices[index].add(delta)
                if not delta.new_text and not delta.finished and not (body.logprobs and delta.new_logprobs):
                    continue
                yield chunk([{
                    "index": index,
                    "delta": {"content": delta.new_text} if delta.new_text or not delta.finished else {},
                    "logprobs": {"content": self._chat_logprobs(delta.new_logprobs or [])} if body.logprobs else None,
                    "finish_reason": delta.finish_reason if delta.finished else None,
                    "stop_reason": delta.stop_reason if delta.finished else None,
                }])
            if body.stream_options and body.stream_options.include_usage:
                yield chunk([], self._usage(prepared, choices.values()))
        except _StreamError as exc:
            yield exc.error.body()
        finally:  # closed early (client gone): no replica request outlives the response
            _cancel_all(streams)
