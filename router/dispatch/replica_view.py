"""What the ingress knows about the replica deployment: health, availability, capacity, limits.

Owns: the look at the ``LLMReplica`` deployment through Serve's controller
(:func:`read_deployment_view`), kept at most :data:`VIEW_TTL_S` old and renewed in the background
(:class:`ReplicaView`); from it ``/health`` (:meth:`ReplicaView.healthy`), the 503 while no
replica can serve (:meth:`ReplicaView.check_available`) and the 400 for a request larger than the
whole deployment can ever hold (:meth:`ReplicaView.check_capacity`); and the replicas' limits
(``max_model_len``, ``vocab_size``: :meth:`ReplicaView.model_info`), fetched once.
"""

# No "from __future__ import annotations", as in router/ingress.py.

import asyncio
import time
from typing import Any, NamedTuple

from ray import serve
from ray.serve.handle import DeploymentHandle

from router.request.errors import replica_error
from router.request.protocol import OpenAIError

VIEW_TTL_S = 1.0
"""How long the ingress trusts its last look at the replica deployment (seconds): its running
replicas for ``/health``, and its replica bound for :meth:`ReplicaView.check_capacity`."""


VIEW_TIMEOUT_S = 3.0
"""How long one look at the deployment may wait for Serve's controller (seconds); then the view is
unknown (``/health`` answers 503, nothing is refused)."""


class DeploymentView(NamedTuple):
    """The replica deployment as Serve's controller reported it (:func:`read_deployment_view`)."""

    checked: float  # time.monotonic() of the look
    known: bool  # False: the controller did not answer; the fields below are then placeholders
    running: int  # replicas in state RUNNING
    status: str  # Serve's deployment status: HEALTHY, UPDATING, UPSCALING, DOWNSCALING, UNHEALTHY, ...
    max_replicas: int | None  # autoscaling max_replicas, else num_replicas; None if not given
    detail: str  # for /health
    min_replicas: int | None = None  # autoscaling min_replicas (0: it may scale to zero); None if fixed


def read_deployment_view(app_name: str, deployment_name: str) -> DeploymentView:
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
    least = scaling.get("min_replicas") if scaling else None
    return DeploymentView(
        time.monotonic(), True, running, status, most if isinstance(most, int) else None,
        f"replicas: {status} ({running} running)", least if isinstance(least, int) else None,
    )


SERVING_STATUSES = ("HEALTHY", "UPSCALING", "DOWNSCALING")
"""Serve deployment statuses of a deployment that is where it should be (UPSCALING/DOWNSCALING:
autoscaled, its running replicas serve meanwhile)."""


def unavailable(view: DeploymentView) -> bool:
    """No replica can serve: none running, and the deployment is not merely scaled to zero."""
    return view.known and view.running == 0 and view.status not in SERVING_STATUSES


class ReplicaView:
    """The ingress's view of the ``LLMReplica`` deployment.

    Args:
        replica: handle of the ``LLMReplica`` deployment.
        seats: each replica's ``max_num_seqs``.
        waiting: each replica's ``max_waiting_requests``.
    """

    def __init__(self, replica: DeploymentHandle, seats: int, waiting: int) -> None:
        self.replica = replica
        self.seats = seats
        self.waiting = waiting
        self._info: dict[str, Any] | None = None
        self._view: DeploymentView | None = None  # the replica deployment, see current()
        self._view_task: asyncio.Task | None = None  # renewing self._view
        self._ready_once = False  # every replica was up at least once (start-up is over)

    async def current(self, fresh: bool = False) -> DeploymentView:
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
            self._view_task = asyncio.create_task(self._renew())
        if view is None or fresh:
            return await asyncio.shield(self._view_task)
        return view

    async def _renew(self) -> DeploymentView:
        try:
            view = await asyncio.to_thread(read_deployment_view, serve.get_replica_context().app_name, self.replica.deployment_name)
        except Exception as exc:  # the controller did not answer: nothing is known
            view = DeploymentView(time.monotonic(), False, 0, "UNKNOWN", None, f"status unavailable: {exc!r}")
        finally:
            self._view_task = None
        self._view = view
        return view

    async def healthy(self) -> tuple[bool, str]:
        """``/health``: (ok, detail) from a view at most :data:`VIEW_TTL_S` old. Ok once every
        replica has been up, and from then on while at least one replica runs; ok at zero
        replicas when autoscaling with ``min_replicas: 0`` took it there (Serve reports it
        healthy or scaling): a request then starts a replica."""
        view = await self.current(fresh=True)
        if not view.known:
            return False, view.detail
        serving = view.status in SERVING_STATUSES
        self._ready_once = self._ready_once or (serving and view.running > 0)
        # After start-up, one running replica is enough to serve while Serve replaces others.
        # An app autoscaled to zero (min_replicas 0) is up: its next request starts a replica, and a
        # load balancer that took it out of rotation would never send that request.
        if view.running == 0 and view.min_replicas == 0 and serving:
            return True, view.detail
        return view.running > 0 and (serving or self._ready_once), view.detail

    async def check_available(self) -> None:
        """Refuse a generation request at once while no replica can serve: the replica deployment
        has no running replica and Serve does not report it as healthy or scaling (its replicas
        died or failed their health checks and are being replaced, or it is still starting).
        Otherwise the request would wait in the handle's queue until a replica is back.

        A deployment at zero replicas that Serve reports healthy or scaling (autoscaling with
        ``min_replicas: 0``) is not refused: its request starts a replica. Uses
        :meth:`current`; a view that says "unavailable" is renewed first if it is older than
        :data:`VIEW_TTL_S`, so only a current view refuses. An unknown view refuses nothing.

        Raises:
            OpenAIError: 503 ``unavailable`` (with ``Retry-After``).
        """
        view = await self.current()
        if unavailable(view):
            view = await self.current(fresh=True)
        if unavailable(view):
            raise OpenAIError(
                f"no replica can serve right now ({view.detail}); retry in a moment",
                503, type="service_unavailable_error", code="unavailable",
            )

    async def check_capacity(self, choices: int, param: str) -> None:
        """Refuse with 400 a request of more choices (prompts x ``n``, one replica request each)
        than the whole deployment can ever hold at once: its most replicas (autoscaling
        ``max_replicas``, else ``num_replicas``, as Serve's controller holds them, so a Serve
        config's overrides count) x (``max_num_seqs`` + ``max_waiting_requests``). Such a request
        would otherwise draw a 429 on every retry.

        A request that one replica can hold costs nothing here; for a larger one the replica
        count comes from :meth:`current`. If it is unknown nothing is refused (the replicas
        then answer 429 as usual).

        Raises:
            OpenAIError: 400 ``invalid_value`` naming ``param`` (``n``, or ``prompt`` for a list
                of prompts), with the limit in the message.
        """
        seats, waiting = self.seats, self.waiting
        if choices <= seats + waiting:
            return
        replicas = (await self.current()).max_replicas
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

    async def model_info(self) -> dict[str, Any]:
        """Limits from a replica (``max_model_len`` depends on its KV pool; ``vocab_size``);
        fetched once. Before that, while no replica can serve, a 503 at once
        (:meth:`check_available`) instead of a wait in Serve's queue.

        Raises:
            OpenAIError: 503 while no replica can serve, 429 when the handle's queue is full.
        """
        if self._info is None:
            await self.check_available()
            try:
                self._info = await self.replica.model_info.remote()
            except Exception as exc:  # a full handle queue → 429, no replica → 503
                raise replica_error(exc) from None
        return self._info
