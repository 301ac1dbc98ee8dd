"""One choice of a response on its replica: :class:`ChoiceStream` (the replica call, its
batched-delta queue, what it takes to start the choice again) and the helpers that end calls
(:func:`cancel`, :func:`cancel_all`) or tell whether a failure allows another replica to start the
choice from scratch (:func:`replica_gone`). ``router/dispatch/fanout.py`` drives them.
"""

# No "from __future__ import annotations", as in router/ingress.py.

import asyncio
import dataclasses
import logging
from typing import Any, Optional

from ray.exceptions import RayActorError

from replica.protocol.envelope import RequestEnvelope
from replica.protocol.errors import EngineDeadError
from router.dispatch.delta_receiver import ConnectionLost, DeltaReceiver, ReplicaUnreachable

logger = logging.getLogger(__name__)


class ChoiceStream:
    """One choice's replica stream (``LLMReplica.generate`` through the streaming handle), with
    what it takes to start the choice again on another replica (``router.dispatch.fanout.Fanout._restart``).

    Attributes:
        index: the choice index (``prompt_index * n + j``).
        envelope: what the replica call carries (:class:`~replica.protocol.envelope.RequestEnvelope`);
            its ``request_id`` gets ``-retry`` appended for the second attempt.
        gen: the current ``DeploymentResponseGenerator`` (or ``DeploymentResponse``).
        retried: the choice was already started again once.
        receiver: with batched deltas, the ingress's :class:`~router.dispatch.delta_receiver.DeltaReceiver`;
            the deltas then arrive on ``queue``, not through ``gen``.
        queue: the choice's delta queue in ``receiver`` (None without batched deltas).
        watch: after admission with batched deltas, the task awaiting the end of ``gen`` (whose
            outcome also goes on ``queue``: :func:`~router.dispatch.delta_receiver.on_call_end`).
    """

    __slots__ = ("index", "envelope", "gen", "retried", "receiver", "queue", "watch")

    def __init__(self, index: int, envelope: RequestEnvelope, gen: Any = None, receiver: Optional[DeltaReceiver] = None) -> None:
        self.index = index
        self.envelope = envelope
        self.gen = gen
        self.retried = False
        self.receiver = receiver
        self.queue: Optional[asyncio.Queue] = None
        self.watch: Optional[asyncio.Future] = None

    @property
    def request_id(self) -> str:
        """The replica request id (the envelope's)."""
        return self.envelope.request_id

    def release(self) -> None:
        """Cancel the current replica call and forget its delta queue (idempotent)."""
        cancel(self.gen)
        if self.watch is not None:
            self.watch.cancel()
            self.watch = None
        if self.queue is not None:
            self.receiver.close(self.request_id)
            self.queue = None

    def start_over(self, exc: BaseException) -> None:
        """Mark this choice as started again (once) after ``exc``: a new request id, logged."""
        logger.warning(
            "replica gone before the first token of %s (%r): starting it again on another replica", self.request_id, exc
        )
        self.retried = True
        self.envelope = dataclasses.replace(self.envelope, request_id=self.envelope.request_id + "-retry")


def cancel(response: Any) -> None:
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


def cancel_all(streams: list[ChoiceStream]) -> None:
    """Cancel every choice's current replica call and forget its deltas (:meth:`ChoiceStream.release`)."""
    for s in streams:
        s.release()


def replica_gone(exc: BaseException) -> bool:
    """True for the failures after which another replica may serve the request from scratch: the
    replica process died or cannot be reached (Ray's ``ActorDiedError``/``ActorUnavailableError``,
    both ``RayActorError``), or its engine loop died (:class:`~replica.protocol.errors.EngineDeadError`),
    raised as is or inside a ``RayTaskError``; or its batched-delta connection could not be made
    or ended (:class:`~router.dispatch.delta_receiver.ReplicaUnreachable`,
    :class:`~router.dispatch.delta_receiver.ConnectionLost`)."""
    gone = (RayActorError, EngineDeadError, ReplicaUnreachable, ConnectionLost)
    return isinstance(exc, gone) or isinstance(getattr(exc, "cause", None), gone)
