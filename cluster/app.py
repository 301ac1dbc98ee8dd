"""Bind the replica deployment and the HTTP ingress into one Serve application; start or join Ray.

``build_app(config)`` returns the Serve ``Application`` (ingress bound to the replicas, and, with
LoRA on, to the ``LoRARegistry`` of served adapters);
``app_builder(args)`` is the same for Serve config files (``import_path: cluster.app:app_builder``,
see ``deploy/serve_config.yaml``);
``start_ray(config)`` starts a local Ray cluster or joins ``config.address`` (with
:data:`SERVE_ENV` in its processes' environment);
``run(config)`` does both plus ``serve.start``/``serve.run``, checks the ``lora_modules`` on a
replica (:func:`check_lora_modules`) and returns the API's base URL. The checks made before Ray
starts (the port, tensor parallelism) are in ``cluster/preflight.py``.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

from cluster.config import ServeConfig
from cluster.preflight import check_replicas_fit, check_tensor_parallel, free_port, listen_problem

__all__ = [
    "INGRESS_DEPLOYMENT", "LORA_REGISTRY_DEPLOYMENT", "REPLICA_DEPLOYMENT", "RESPONSE_STORE_DEPLOYMENT", "SERVE_ENV", "app_builder", "apply_serve_env",
    "base_url", "build_app", "check_lora_modules", "check_tensor_parallel", "direct_ingress_env", "free_port",
    "listen_problem", "replica_deployment_options", "replicas_for_resources", "resolve_replicas", "run", "start_ray",
    "uses_direct_ingress",
]

logger = logging.getLogger(__name__)

REPLICA_DEPLOYMENT = "LLMReplica"
INGRESS_DEPLOYMENT = "OpenAIIngress"
LORA_REGISTRY_DEPLOYMENT = "LoRARegistry"
RESPONSE_STORE_DEPLOYMENT = "ResponseStore"
GRACEFUL_SHUTDOWN_WAIT_LOOP_S = 0.2
"""How often (seconds) a stopping replica or ingress checks for requests still running. Serve's
default, 2 s, is also the least time any replica takes to stop, even an idle one: each redeploy,
scale-down or shutdown waited that long for nothing."""


SERVE_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}
"""Ray Serve settings for the processes of a Carpool cluster (environment variables, read when a
process imports Serve; a value already in the environment wins).

``RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0`` (one of the settings of Serve's own
``RAY_SERVE_THROUGHPUT_OPTIMIZED`` mode): the ingress and replica code run on the replica's main
event loop, not on a second loop in another thread, so each streamed delta skips a hand-over
between threads in the ingress and in the replica. The mode's other settings stay at Serve's
defaults: its gRPC transport between deployments left some requests of a burst waiting far longer
for their first token, and a router on the caller's loop breaks the CLI's synchronous handle
calls. Its direct ingress is set by :func:`run` alone, on the configured port
(:func:`direct_ingress_env`). Measured in ``docs/bench/cpu-speed.md``, "A third run, on a slower
machine, and Serve's settings".

Where it is set: :func:`start_ray` for a local cluster; ``deploy/Dockerfile`` for every process of
the image; the ``runtime_env`` of ``deploy/serve_config.yaml`` (and ``rayservice.yaml``) for the
app's processes (a test keeps the three equal to this dict).
"""


def apply_serve_env() -> None:
    """Put :data:`SERVE_ENV` into this process's environment where not already set, so that a Ray
    cluster started from here (``ray.init``) passes it to all its processes."""
    for name, value in SERVE_ENV.items():
        os.environ.setdefault(name, value)


def direct_ingress_env(port: int) -> dict[str, str]:
    """Ray Serve settings (environment variables of every process of a local cluster) under which
    the one ingress replica serves HTTP on ``port`` itself: Serve's *direct ingress*, one of the
    settings of its ``RAY_SERVE_THROUGHPUT_OPTIMIZED`` mode.

    Without it, every request and every streamed event goes through Serve's HTTP proxy, a
    separate process that relays each event to the client over one more Ray stream. Direct
    ingress serves the same ASGI app with uvicorn inside the ingress replica; the proxy still
    runs but no client uses it (what that saves: ``docs/bench/cpu-speed.md``, "Side by side", the
    column "direct ingress alone").

    Serve hands direct-ingress ports out of ``[MIN, MAX)``; a range of exactly ``port`` keeps a
    replaced ingress replica on the same port. Serve's port quarantine (a delay before a released
    port is handed out again, for HAProxy) and its minimum draining period (time for an external
    load balancer to notice a stopping replica) are set to 0: nothing stands in front, and
    ``carpool serve`` drains the ingress itself before stopping.
    """
    return {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
    }


def uses_direct_ingress(config: ServeConfig) -> bool:
    """Whether :func:`run` serves HTTP from the ingress replica itself (:func:`direct_ingress_env`):
    ``config.direct_ingress``, one ingress replica, and a local Ray cluster that :func:`run` starts
    (so its processes get the settings). Needs ``ray`` importable; reads ``ray.is_initialized()``."""
    import ray

    return config.direct_ingress and config.ingress_replicas == 1 and not config.address and not ray.is_initialized()


def start_ray(config: ServeConfig, **init_kwargs: Any) -> None:
    """Start a local Ray cluster (``address=None``) or join ``config.address``; no-op if connected.

    A local cluster's processes get :data:`SERVE_ENV` (:func:`apply_serve_env`); a joined
    cluster keeps the environment its nodes were started with. Extra keyword arguments go to
    ``ray.init`` (e.g. ``num_cpus`` for a local cluster).
    """
    import ray

    if ray.is_initialized():
        return
    apply_serve_env()
    if config.address:
        ray.init(address=config.address, **init_kwargs)
    else:
        init_kwargs.setdefault("include_dashboard", config.include_dashboard)
        ray.init(address="local", **init_kwargs)


def resolve_replicas(config: ServeConfig) -> int:
    """The replica count: ``config.replicas``, or for ``auto`` one per GPU in the cluster when the
    device is CUDA and one per CPU core (``num_cpus_per_replica`` cores each) otherwise.
    Needs a connected Ray cluster for ``auto``."""
    if config.replicas != "auto":
        return int(config.replicas)
    import ray

    return replicas_for_resources(config, ray.cluster_resources())


def replicas_for_resources(config: ServeConfig, resources: dict[str, float]) -> int:
    """``replicas=auto`` for a cluster with these resources (``ray.cluster_resources()``): one
    replica per ``tensor_parallel_size`` GPUs when the device is CUDA, else one per
    ``tensor_parallel_size × num_cpus_per_replica`` CPUs (at least one). An explicit
    ``config.replicas`` is returned as is.

    Raises:
        ValueError: the device is CUDA and the cluster has fewer GPUs than one replica needs.
    """
    if config.replicas != "auto":
        return int(config.replicas)
    tp = config.engine.tensor_parallel_size
    if config.engine.device.startswith("cuda"):
        gpus = int(resources.get("GPU", 0))
        if gpus < 1:
            raise ValueError("replicas=auto with device=cuda, but the Ray cluster has no GPU")
        if gpus < tp:
            raise ValueError(f"replicas=auto with device=cuda needs {tp} GPUs per replica, but the Ray cluster has {gpus}")
        return gpus // tp
    return max(1, math.floor(resources.get("CPU", os.cpu_count() or 1) / (tp * config.num_cpus_per_replica)))


def replica_deployment_options(config: ServeConfig, num_replicas: int | None) -> dict[str, Any]:
    """Serve deployment options of ``LLMReplica`` (those a Serve config file's ``deployments``
    entry can override, plus the health-check timings).

    One GPU per replica on CUDA (``ray_actor_options={"num_cpus": ..., "num_gpus": 1}``), so
    replicas spread one per GPU; on CPU ``num_cpus_per_replica`` cores and no GPU. A
    tensor-parallel replica (``tensor_parallel_size`` N > 1) reserves N such bundles on one node
    (``placement_group_bundles``, ``STRICT_PACK``, as Ray Serve LLM does): the replica actor takes
    the first, its other ranks the rest (``replica/serve/tp_ranks.py``). With
    ``config.autoscaling`` the deployment gets an ``autoscaling_config`` and no ``num_replicas``
    (Serve rejects both); otherwise ``num_replicas`` is fixed.

    Raises:
        ValueError: ``num_replicas`` given together with ``config.autoscaling``.
    """
    actor_options: dict[str, Any] = {"num_cpus": config.num_cpus_per_replica}
    if config.engine.device.startswith("cuda"):
        actor_options["num_gpus"] = 1
    tp = config.engine.tensor_parallel_size
    group: dict[str, Any] = {}
    if tp > 1:
        bundle = {"CPU": actor_options["num_cpus"], **({"GPU": 1} if "num_gpus" in actor_options else {})}
        group = {"placement_group_bundles": [dict(bundle) for _ in range(tp)], "placement_group_strategy": "STRICT_PACK"}
    options: dict[str, Any] = {
        **group,
        "name": REPLICA_DEPLOYMENT,
        "max_ongoing_requests": config.max_ongoing_requests,
        "ray_actor_options": actor_options,
        "health_check_period_s": 5.0,
        "health_check_timeout_s": 30.0,
        "graceful_shutdown_timeout_s": 5.0,
        "graceful_shutdown_wait_loop_s": GRACEFUL_SHUTDOWN_WAIT_LOOP_S,
    }
    if config.autoscaling is not None:
        if num_replicas is not None:
            raise ValueError("num_replicas cannot be combined with autoscaling")
        options["autoscaling_config"] = config.autoscaling.serve_options()
        # A replica scaled down takes no new requests and finishes those it runs, up to this long.
        options["graceful_shutdown_timeout_s"] = config.autoscaling.drain_timeout_s
        most = config.autoscaling.max_replicas
    else:
        options["num_replicas"] = most = num_replicas if num_replicas is not None else resolve_replicas(config)
    # Each replica refuses what it cannot hold (replica/serve/deployment.py: 429). This bounds the
    # ingress's handle queue while no replica can take a request (e.g. none running yet); past it
    # the handle raises BackPressureError, which the ingress answers with 429 too.
    options["max_queued_requests"] = most * (config.engine.max_num_seqs + config.max_waiting_requests) + 64
    # Should a BackPressureError get past the ingress's own mapping, Serve answers 429 + Retry-After
    # (its default is 503 without one).
    from router.request.errors import RETRY_AFTER_S

    options["backpressure_config"] = {"status_code": 429, "retry_after_s": RETRY_AFTER_S}
    return options


def build_app(config: ServeConfig, num_replicas: int | None = None):
    """The Serve application: an ``OpenAIIngress`` bound to the ``LLMReplica`` deployment.

    Args:
        config: serving settings.
        num_replicas: overrides :func:`resolve_replicas` (which needs Ray for ``auto``); must be
            None when ``config.autoscaling`` is set.
    Returns:
        a ``ray.serve.Application`` for ``serve.run``. Its deployments are named ``LLMReplica``
        and ``OpenAIIngress``, the names a Serve config's ``deployments`` entries refer to, and,
        with ``engine.enable_lora``, ``LoRARegistry`` (one replica holding the served adapters'
        names and folders for every ingress replica: ``router/lora/lora_registry.py``), and, with
        ``response_store: serve`` (the default), ``ResponseStore`` (one replica holding the stored
        responses of ``/v1/responses`` for every ingress replica:
        ``router/responses/store_deployment.py``).
    """
    from ray import serve
    from ray.serve.config import BackpressureConfig, RequestRouterConfig

    from replica.serve import LLMReplica
    from router.ingress import OpenAIIngress
    from router.lora.lora_registry import LoRARegistry
    from router.responses.store_deployment import ResponseStoreDeployment
    from router.request.errors import RETRY_AFTER_S
    from router.routing.policy import CarpoolRequestRouter

    engine = config.engine
    threads = max(1, math.floor(config.num_cpus_per_replica))
    replica = serve.deployment(
        LLMReplica,
        **replica_deployment_options(config, num_replicas),
        request_router_config=RequestRouterConfig(
            request_router_class=CarpoolRequestRouter,
            request_router_kwargs={
                "prefix_aware": config.prefix_aware_routing,
                "lora_aware": config.lora_aware_routing and engine.enable_lora,
                "max_loras": engine.max_loras,
            },
            request_routing_stats_period_s=config.routing_stats_period_s,
            request_routing_stats_timeout_s=max(5.0, 4 * config.routing_stats_period_s),
        ),
    ).bind(engine.model_dump(), threads, config.model_name, config.max_waiting_requests)
    registry = None
    if engine.enable_lora:
        registry = serve.deployment(
            LoRARegistry,
            name=LORA_REGISTRY_DEPLOYMENT,
            num_replicas=1,  # one owner of the mapping: its adds and removes are atomic
            max_ongoing_requests=4096,
            ray_actor_options={"num_cpus": 0},
            graceful_shutdown_timeout_s=1.0,
            graceful_shutdown_wait_loop_s=GRACEFUL_SHUTDOWN_WAIT_LOOP_S,
        ).bind(config.lora_modules)
    store = None
    if config.response_store == "serve":
        store = serve.deployment(
            ResponseStoreDeployment,
            name=RESPONSE_STORE_DEPLOYMENT,
            num_replicas=1,  # one owner of the stored responses, for every ingress replica
            max_ongoing_requests=4096,
            ray_actor_options={"num_cpus": 0},
            graceful_shutdown_timeout_s=1.0,
            graceful_shutdown_wait_loop_s=GRACEFUL_SHUTDOWN_WAIT_LOOP_S,
        ).bind(config.response_store_max_bytes, config.response_store_ttl_s)
    ingress = serve.deployment(
        OpenAIIngress,
        name=INGRESS_DEPLOYMENT,
        num_replicas=config.ingress_replicas,
        # Every open HTTP stream is one ongoing request of the ingress.
        max_ongoing_requests=max(4096, 4 * config.max_ongoing_requests),
        # Requests the proxy holds for a busy ingress, at most; past it the proxy answers 429.
        max_queued_requests=max(4096, 4 * config.max_ongoing_requests),
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=RETRY_AFTER_S),
        ray_actor_options={"num_cpus": 0},
        graceful_shutdown_timeout_s=5.0,
        graceful_shutdown_wait_loop_s=GRACEFUL_SHUTDOWN_WAIT_LOOP_S,
    ).bind(replica, config.ingress_fields(), engine.model_dump(), registry, store)
    return ingress


def app_builder(args: dict[str, Any]):
    """Serve application builder for config files (``import_path: cluster.app:app_builder``).

    ``args`` are :class:`~cluster.config.ServeConfig` fields (engine settings under ``engine``),
    validated by pydantic; the app is made by :func:`build_app`, as for ``carpool serve``.
    ``host``, ``port``, ``address`` and ``app_name`` do not apply here: the config file's
    ``http_options`` and application ``name`` do. Without ``replicas`` or ``autoscaling`` in
    ``args`` the code default is one replica, and the config's
    ``deployments: [{name: LLMReplica, num_replicas | autoscaling_config, ...}]`` sets the count
    (Serve's own override), so building never needs the cluster's GPUs to be up yet.

    Raises:
        pydantic.ValidationError: a bad or unknown argument (Serve reports it as a deploy failure).
    """
    config = ServeConfig.model_validate(args)
    ignored = sorted({"host", "port", "address", "app_name"} & config.model_fields_set)
    if ignored:
        logger.warning(
            "app_builder ignores %s: a Serve config sets them in http_options and the application's name",
            ", ".join(ignored),
        )
    sized = "replicas" in config.model_fields_set or config.autoscaling is not None
    return build_app(config, None if sized else 1)


def run(config: ServeConfig) -> str:
    """Start or join Ray, start Serve's HTTP serving on ``config.host:config.port``, deploy the app
    and wait until every replica has loaded its model. Returns the base URL (``http://host:port/v1``).

    With :func:`uses_direct_ingress`, the ingress replica serves ``config.port`` itself and Serve's
    proxy gets a free port of its own; otherwise the proxy serves ``config.port``.
    """
    from ray import serve

    proxy_port = config.port
    if uses_direct_ingress(config):
        os.environ.update(direct_ingress_env(config.port))
        proxy_port = free_port(config.host)  # the proxy must not take the ingress's port
        logger.info("direct ingress: the ingress serves port %d; Serve's proxy listens on %d", config.port, proxy_port)
    spec = config.engine.speculative_config
    if spec is not None and spec.method == "draft_model":  # before Ray: a bad draft fails fast, named
        from replica.config.model_files import check_draft_model

        check_draft_model(config.engine.model, spec.model, config.engine.tokenizer)
    from replica.config.model_files import check_gguf_file, check_gguf_model

    # Before Ray: a model that is no GGUF file with quantization gguf, or a missing or broken .gguf file, named.
    (check_gguf_model if config.engine.quantization == "gguf" else check_gguf_file)(config.engine.model)
    from replica.quant.checkpoint import check_checkpoint

    # Before Ray: a checkpoint quantized by a method or scheme Carpool does not serve, or a setting that does not fit it.
    check_checkpoint(config.engine.model, config.engine.quantization, config.engine.tensor_parallel_size)
    from replica.pooling import check_pooling_settings

    check_pooling_settings(config.engine)  # an embedding model with generation-only settings: said before Ray
    start_ray(config)
    check_tensor_parallel(config)
    scaling = config.autoscaling
    replicas = max(scaling.min_replicas, scaling.initial_replicas or 0) if scaling is not None else resolve_replicas(config)
    check_replicas_fit(config, replicas)
    serve.start(http_options={"host": config.host, "port": proxy_port})
    if scaling is not None:
        logger.info("deploying %d to %d autoscaled replica(s) of %s", scaling.min_replicas, scaling.max_replicas, config.engine.model)
        app = build_app(config)
    else:
        logger.info("deploying %d replica(s) of %s", replicas, config.engine.model)
        app = build_app(config, replicas)
    serve.run(app, name=config.app_name, route_prefix="/")
    check_lora_modules(config)
    return base_url(config)


def check_lora_modules(config: ServeConfig, timeout_s: float = 120.0) -> None:
    """Ask one replica of the running app to read and check each of ``config.lora_modules``
    (``LLMReplica.check_lora``), so that a bad adapter stops ``carpool serve`` at start, named,
    instead of failing its clients' requests later.

    Raises:
        ValueError: ``lora_modules: <name>=<path>: <the reason>`` for the first adapter refused.
    """
    if not config.lora_modules:
        return
    from ray import serve

    from replica.protocol.errors import LoRAAdapterError
    from replica.protocol.lora_request import LoRARequest

    handle = serve.get_deployment_handle(REPLICA_DEPLOYMENT, app_name=config.app_name)
    for name, path in config.lora_modules.items():
        try:
            info = handle.check_lora.remote(LoRARequest(name, 0, path)).result(timeout_s=timeout_s)
        except Exception as exc:
            cause = getattr(exc, "cause", exc)
            if isinstance(cause, LoRAAdapterError):
                raise ValueError(f"lora_modules: {name}={path}: {cause}") from None
            raise
        logger.info("LoRA adapter %r: rank %s, %d modules, from %s", name, info["rank"], len(info["target_modules"]), path)


def base_url(config: ServeConfig) -> str:
    host = "127.0.0.1" if config.host in ("0.0.0.0", "::", "") else config.host
    return f"http://{host}:{config.port}/v1"
