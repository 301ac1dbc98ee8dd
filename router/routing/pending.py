"""What the request router knows of a pending Serve request: its
:class:`~replica.protocol.envelope.RequestEnvelope` (:func:`envelope_of`, the one place that looks
it up) and Serve's internal id (:func:`request_key`).

The ingress sends each replica request (``LLMReplica.generate``/``generate_all``) with its
envelope as the keyword :data:`~replica.protocol.envelope.ENVELOPE_KEYWORD`; the router reads the
envelope's named fields (``routing.prefix_hashes``, ``routing.adapter``) and nothing else of the
call. Every other call (``model_info``, ``check_lora``, ...) carries none and is routed on load.
"""

from __future__ import annotations

from typing import Any

from replica.protocol.envelope import ENVELOPE_KEYWORD, ROUTED_METHODS, RequestEnvelope


class MissingEnvelopeError(LookupError):
    """A ``generate``/``generate_all`` call reached the request router without its envelope under
    the keyword ``request``: the ingress and the replica no longer agree on the call's shape."""


def envelope_of(pending_request: Any) -> RequestEnvelope | None:
    """The envelope of a pending Serve request (``ray.serve.request_router.PendingRequest``), or
    None for no request (``pending_request`` None) or a call of another method than
    :data:`~replica.protocol.envelope.ROUTED_METHODS`.

    Raises:
        MissingEnvelopeError: a ``generate``/``generate_all`` call without a ``RequestEnvelope`` as
            its keyword ``request``.
    """
    if pending_request is None:
        return None
    method = pending_request.metadata.call_method
    if method not in ROUTED_METHODS:
        return None
    envelope = pending_request.kwargs.get(ENVELOPE_KEYWORD)
    if not isinstance(envelope, RequestEnvelope):
        raise MissingEnvelopeError(
            f"a {method} call reached the request router without its RequestEnvelope as the keyword "
            f"{ENVELOPE_KEYWORD!r} (it has {len(pending_request.args)} positional arguments and the keywords "
            f"{sorted(pending_request.kwargs)}): call {method}.remote({ENVELOPE_KEYWORD}=envelope, ...)"
        )
    return envelope


def request_key(pending_request: Any) -> str | None:
    """Serve's internal id of a pending request (the key of what the router holds for it until
    Serve confirms its replica), or None without a request."""
    if pending_request is None:
        return None
    return pending_request.metadata.internal_request_id
