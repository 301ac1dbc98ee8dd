"""OpenAI error responses, and the checks that run before routing (API key, body size).

Owns: turning every failure into OpenAI's JSON error shape with the right status and headers
(:func:`error_response`, counted in ``carpool:http_requests_rejected_total``); the FastAPI
exception handlers for bad bodies, unknown paths and oversized bodies; the mapping of pydantic
validation errors (:func:`validation_error`), of ``SamplingParams`` refusals
(:func:`sampling_error`), of unusable LoRA adapters (:func:`lora_error`) and of replica failures
(:func:`replica_error`) to statuses; and the
:class:`RequestGuard` middleware that checks the API key and the body size before routing.
:func:`install` puts the handlers and the middleware on the ingress's app.
"""

# No "from __future__ import annotations", as in router/ingress.py (FastAPI reads the handlers' types).

import hmac
import json
import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray.serve.exceptions import BackPressureError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.body_limit import RequestBodyLimitMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from replica.protocol.errors import (
    EngineDeadError,
    LoRAAdapterError,
    LatencyTargetError,
    ReplicaOverloadedError,
    RequestAbortedError,
    RequestError,
    RequestFailedError,
)
from router.request.protocol import ChatCompletionRequest, CompletionRequest, OpenAIError

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # the Retry-After of a 429 or 503 (seconds)


class _Guard:
    """What the request guard and the error handlers of this process need (see :func:`configure`)."""

    api_key: str | None = None
    max_request_body_bytes: int | None = None
    metrics = None  # router.observability.metrics.IngressMetrics


_guard = _Guard()


def configure(api_key: str | None, max_request_body_bytes: int | None, metrics) -> None:
    """Set this process's API key, body cap (bytes) and ingress metrics (``OpenAIIngress`` calls it).

    Serve runs a pickled copy of the ingress's ``app``, and the ingress class is pickled by value
    (the module's name ``OpenAIIngress`` is Serve's wrapper), so neither ``app.state`` nor a global
    read in ``OpenAIIngress.__init__`` is what the middleware sees; this function, pickled by
    reference, sets this module's own ``_guard``.
    """
    _guard.api_key = api_key
    _guard.max_request_body_bytes = max_request_body_bytes
    _guard.metrics = metrics


# ---- error responses ---------------------------------------------------------------------------
class JSONBody(JSONResponse):
    """Starlette's JSON response, but a lone UTF-16 surrogate in a string is written as its JSON
    escape (``\\ud800``) instead of raising ``UnicodeEncodeError`` (a 500 in plain text).

    JSON's ``"\\ud800"`` parses to such a string, and a client's strings come back in bodies
    (``metadata``, ``user``) and error messages (``model``, ``previous_response_id``): UTF-8
    cannot encode them, and the escape reads back as the string sent. The ingress's default
    response class and every error's.
    """

    def render(self, content: Any) -> bytes:
        text = json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))
        return text.encode("utf-8", "backslashreplace")  # only surrogates fail: U+D800 → b"\\ud800"


def error_response(err: OpenAIError) -> JSONResponse:
    """The JSON response of an error (``WWW-Authenticate`` on 401, ``Retry-After`` on 429 and
    503), counted in ``carpool:http_requests_rejected_total``."""
    headers = None
    if err.status_code == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    elif err.status_code in (429, 503):
        headers = {"Retry-After": str(err.retry_after_s or RETRY_AFTER_S)}
        if not err.should_retry:
            headers["x-should-retry"] = "false"
    if _guard.metrics is not None:
        _guard.metrics.on_rejected(err.status_code, err.code)
    return JSONBody(err.body(), status_code=err.status_code, headers=headers)


class StreamError(Exception):
    """An error met while a streamed response is under way; it goes out as one error event.

    Attributes:
        error: the :class:`OpenAIError` to send.
    """

    def __init__(self, error: OpenAIError) -> None:
        super().__init__(error.message)
        self.error = error


async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
    return error_response(exc)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    content_type = request.headers.get("content-type")
    if request.method == "POST" and not (content_type and _is_json(content_type)):
        # FastAPI hands a body without a JSON Content-Type to the model as bytes, which fails.
        got = repr(content_type) if content_type else "none"
        message = f"Content-Type must be application/json, got {got}"
        return error_response(OpenAIError(message, 415, code="unsupported_media_type"))
    return error_response(validation_error(exc.errors()))


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 413:
        return error_response(_body_too_large())
    if exc.status_code == 400 and exc.__cause__ is not None:
        # FastAPI's 400 for a body json.loads raised on with something other than a JSONDecodeError
        # (those come as RequestValidationError); the cause says what.
        return error_response(_unparsable_body(exc.__cause__))
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return error_response(OpenAIError(message, exc.status_code))


def install(app: FastAPI) -> None:
    """Answer every error of ``app`` in OpenAI's shape (its exception handlers) and check the API
    key and body size before routing (:class:`RequestGuard`)."""
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_middleware(RequestGuard)


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


API_FIELDS = frozenset(ChatCompletionRequest.model_fields) | frozenset(CompletionRequest.model_fields)
"""The top-level fields of the request bodies: a ``param`` names one of them (or a path in one)."""


def sampling_error(exc: ValueError) -> OpenAIError:
    """The 400 for a ``ValueError`` from ``SamplingParams``/the engine. Its message starts with
    the field at fault (a dotted path such as ``structured_outputs.choice:`` or
    ``tools.0.function.parameters:``), which becomes ``param`` when it starts with one of
    :data:`API_FIELDS`; a first word that names no field (``request_id ...``) gives no param."""
    message = str(exc)
    first = message.split(" ", 1)[0].rstrip(":")
    parts = first.split(".")
    named = parts[0] in API_FIELDS and all(p.isidentifier() or p.isdigit() for p in parts)
    return OpenAIError(message, param=first if named else None, code="invalid_value")


def request_error(exc: RequestError) -> OpenAIError:
    """The 400 for a request rule broken (:mod:`replica.protocol.request_checks`), whichever side
    found it: its message, ``param`` and ``code`` (``invalid_value``, ``context_length_exceeded``)."""
    return OpenAIError(str(exc), param=exc.param, code=exc.code)


def lora_error(exc: LoRAAdapterError, param: str = "model") -> OpenAIError:
    """The 400 ``invalid_lora_adapter`` for an adapter a replica cannot use (its message names the
    adapter and the reason); ``param`` is the field that named it (``model`` in a generation
    request, ``lora_path`` in a load)."""
    return OpenAIError(str(exc), param=param, code="invalid_lora_adapter")


MAX_RETRY_AFTER_S = 60
"""The longest ``Retry-After`` a shed request is told (seconds)."""


def latency_target_error(exc: LatencyTargetError) -> OpenAIError:
    """The 429 ``slo_unattainable`` of a request shed for its TTFT target: ``Retry-After`` is how
    much later than its target the replica predicted its first token (whole seconds, 1 to
    :data:`MAX_RETRY_AFTER_S`), and ``x-should-retry: false`` keeps the ``openai`` clients from
    retrying on their own a request that asked to be refused at once."""
    late_s = exc.predicted_s - exc.target_s
    retry = MAX_RETRY_AFTER_S if not math.isfinite(late_s) else min(MAX_RETRY_AFTER_S, max(1, math.ceil(late_s)))
    predicted = f"{exc.predicted_s:.2f} s" if math.isfinite(exc.predicted_s) else "beyond the replica's queue"
    return OpenAIError(
        f"the request asked to be shed rather than served late (x-slo-shed), and its predicted time to "
        f"first token ({predicted}) exceeds its target ({exc.target_s * 1000:.0f} ms, x-slo-ttft-ms); retry later",
        429, type="overloaded_error", param="x-slo-ttft-ms", code="slo_unattainable", retry_after_s=retry,
        should_retry=False,
    )


def _cause_of(exc: BaseException, kind: type) -> BaseException | None:
    """``exc`` or the replica's own exception it carries (a ``RayTaskError``'s ``cause``) when that
    is a ``kind``; else None."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, kind):
        return cause
    return exc if isinstance(exc, kind) else None


def replica_error(exc: BaseException) -> OpenAIError:
    """Map an exception raised while streaming from a replica to an OpenAI error.

    An adapter the replica cannot use (:class:`~replica.protocol.errors.LoRAAdapterError`) → 400
    ``invalid_lora_adapter`` (:func:`lora_error`); a request rule broken
    (:class:`~replica.protocol.errors.RequestError`, e.g. a prompt too long for the replica's own
    ``max_model_len``) → its 400 (:func:`request_error`); another ``ValueError`` (the engine refused the
    request) → 400; a request shed for its TTFT target
    (:class:`~replica.protocol.errors.LatencyTargetError`) → 429 ``slo_unattainable``
    (:func:`latency_target_error`); a full replica
    (:class:`~replica.protocol.errors.ReplicaOverloadedError`) or a full handle queue (Serve's
    ``BackPressureError``) → 429 with ``Retry-After``; an internal error of the engine that ended
    this request alone (``RequestFailedError``) → 500; anything else (the replica process died,
    its engine loop stopped, the server ended the request while shutting down) → 503, so that
    clients retry. An :class:`OpenAIError` is returned as is.
    """
    if isinstance(exc, OpenAIError):
        return exc
    late = _cause_of(exc, LatencyTargetError)
    if late is not None:
        return latency_target_error(late)
    if isinstance(exc, (ReplicaOverloadedError, BackPressureError)):
        return OpenAIError(
            "the server is at capacity (every replica's waiting queue is full); retry after a moment",
            429,
            type="overloaded_error",
            code="overloaded",
        )
    bad_adapter = _cause_of(exc, LoRAAdapterError)
    if bad_adapter is not None:
        return lora_error(bad_adapter)
    broken_rule = _cause_of(exc, RequestError)
    if broken_rule is not None:
        return request_error(broken_rule)
    cause = getattr(exc, "cause", None)  # a RayTaskError carries the replica's own exception
    if isinstance(exc, ValueError):
        return sampling_error(cause if isinstance(cause, ValueError) else exc)
    original = cause if isinstance(cause, BaseException) else exc
    logger.warning("replica request failed: %r", original)
    if isinstance(original, RequestFailedError):
        return OpenAIError(str(original), 500, type="internal_server_error", code="internal_error")
    if isinstance(original, (RequestAbortedError, EngineDeadError)):
        detail = str(original)
    else:  # e.g. ray.exceptions.ActorDiedError: the replica process is gone
        detail = f"the replica serving this request failed ({type(original).__name__}); retry"
    return OpenAIError(detail, 503, type="service_unavailable_error", code="unavailable")


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
            await error_response(error)(scope, receive, send)
            return
        if _guard.max_request_body_bytes is None:
            await self.app(scope, receive, send)
            return
        await RequestBodyLimitMiddleware(self.app, _guard.max_request_body_bytes)(scope, receive, send)
