"""The delta channel's wire format: one frame per engine step, a 4-byte big-endian length then a pickled
``list[tuple[request_id, EngineOutput | Exception]]`` (:mod:`replica.serve.delta_channel` writes frames,
``router/dispatch/delta_receiver.py`` reads them). Plain Python, no torch or Ray.
"""

from __future__ import annotations

import pickle
import struct
from typing import Any

from replica.protocol.errors import RequestFailedError

HEADER = struct.Struct("!I")
"""Frame header: the pickled payload's length in bytes (unsigned, big-endian)."""


KEY_BYTES = 32
"""Length of an ingress key on the wire (hex characters, newline excluded)."""


def encode_frame(items: list[tuple[str, Any]]) -> bytes:
    """One frame: :data:`HEADER` then ``pickle.dumps(items)`` (highest protocol). An item that
    would not pickle, or an exception that would not unpickle (one whose ``__init__`` takes other
    arguments than its ``args``), goes as a ``RequestFailedError`` with its ``repr`` instead, so
    that one bad item never costs the frame's other deltas or breaks the connection."""
    if any(isinstance(item, BaseException) for _, item in items):
        items = [(request_id, _sendable(item)) for request_id, item in items]
    try:
        payload = pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        payload = pickle.dumps([(r, _sendable(item, check_all=True)) for r, item in items], protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(payload)) + payload


def _sendable(item: Any, check_all: bool = False) -> Any:
    """``item``, or a ``RequestFailedError`` in its place if it does not survive a pickle round
    trip (checked for exceptions, and for everything with ``check_all``)."""
    if not (check_all or isinstance(item, BaseException)):
        return item
    try:
        pickle.loads(pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception:
        return RequestFailedError(f"the replica could not send this request's output: {item!r}")
    return item
