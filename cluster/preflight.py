"""Checks ``carpool serve`` makes before it starts Ray or deploys, so that a setting that could never
work stops it at once, named, instead of failing half a minute later in Serve's logs: the HTTP
address can be listened on (:func:`listen_problem`), a tensor-parallel replica fits a node
(:func:`check_tensor_parallel`), a local cluster can place every replica (:func:`check_replicas_fit`);
and :func:`free_port`. ``cluster.app`` imports them (and its
:func:`~cluster.app.run` calls them); its names for them stay valid.
"""

from __future__ import annotations

import math

from cluster.config import ServeConfig


def free_port(host: str) -> int:
    """A TCP port of ``host`` that is free now (the OS picks it)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def listen_problem(host: str, port: int) -> str | None:
    """Why a server cannot listen on ``host:port`` now (a host that does not resolve or is not
    this machine's, a port in use or not allowed), or None.

    Binds a socket the way uvicorn (Serve's HTTP server) does: IPv6 where the host has a ``:``,
    else IPv4; ``""`` is every interface. ``SO_REUSEADDR`` is set, as Serve sets it, so connections
    of a server that just stopped (TIME_WAIT) do not count, and a server listening there does.
    """
    import errno
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        address = socket.getaddrinfo(host or None, port, family, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)[0][4]
    except (socket.gaierror, UnicodeError) as exc:  # UnicodeError: not a host name (idna: an empty label)
        return f"host: {host!r} cannot be resolved ({getattr(exc, 'strerror', None) or exc})"
    shown = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host or '0.0.0.0'}:{port}"
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRNOTAVAIL:
                return f"host: {host!r} is not an address of this machine ({exc.strerror})"
            hint = "; stop what holds it or pick another --port" if exc.errno == errno.EADDRINUSE else ""
            return f"port: {shown} cannot be listened on ({exc.strerror}){hint}"
    return None


def _as_ray_counts(amount: float) -> float:
    """``amount`` of a resource as Ray counts it: cut to 4 decimals."""
    return math.floor(amount * 1e4) / 1e4


def rank_resources(config: ServeConfig) -> dict[str, float]:
    """What each rank of a replica reserves (``cluster.app.replica_deployment_options``), as Ray
    counts it (:func:`_as_ray_counts`): ``num_cpus_per_replica`` CPUs and, on CUDA, one GPU."""
    cpus = _as_ray_counts(config.num_cpus_per_replica)
    return {"CPU": cpus, "GPU": 1.0} if config.engine.device.startswith("cuda") else {"CPU": cpus}


def check_tensor_parallel(config: ServeConfig) -> None:
    """Refuse, before deploying, a tensor-parallel replica that could never start: the model's heads
    do not split over ``tensor_parallel_size``, or no node of the Ray cluster has what its ranks
    reserve (:func:`rank_resources`: CPUs, and GPUs on CUDA; its bundles are packed on one node),
    which would leave it pending forever.

    Raises:
        ValueError: naming the head counts, or what one replica needs and the most any node has.
    """
    tp = config.engine.tensor_parallel_size
    if tp == 1:
        return
    import ray

    from replica.config.model_files import check_tp_size, resolve_model_path

    check_tp_size(resolve_model_path(config.engine.model, weights=False), tp)
    nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
    for kind, each in rank_resources(config).items():
        most, need = max((node.get(kind, 0.0) for node in nodes), default=0.0), round(tp * each, 4)
        if most + 1e-9 < need:
            fix = ("; give each rank fewer cores (num_cpus_per_replica in a config file, e.g. "
                   f"{_as_ray_counts(most / tp):g}: the ranks then share them)") if kind == "CPU" and most > 0 else ""
            raise ValueError(
                f"tensor_parallel_size {tp} needs {need:g} {kind}s on one node for each replica; "
                f"the largest node of the Ray cluster has {most:g}{fix}"
            )


def check_replicas_fit(config: ServeConfig, replicas: int) -> None:
    """Refuse, before deploying, more replicas than a local Ray cluster (one without
    ``config.address``: the cluster Carpool starts, or the one this process already runs) can ever
    place. Each replica has ``tensor_parallel_size`` ranks, each reserving :func:`rank_resources`;
    a local cluster never gains nodes, so replicas beyond its devices would wait for them forever,
    without a word. ``replicas`` is the fixed count, or with autoscaling the replicas it deploys
    first (``initial_replicas``, else ``min_replicas``). A joined cluster (``--address``) may gain
    nodes (KubeRay's autoscaler adds a pod for a pending replica): not checked.

    Raises:
        ValueError: naming the replicas, what they need, what the cluster has, and the settings
            that would fit.
    """
    if config.address:
        return
    import ray

    tp = config.engine.tensor_parallel_size
    resources = ray.cluster_resources()
    for kind, each in rank_resources(config).items():
        have, need = resources.get(kind, 0.0), round(replicas * tp * each, 4)
        if need <= have + 1e-9:
            continue
        shape = f" of tensor_parallel_size {tp}" if tp > 1 else ""
        count = "--autoscale's MIN, or initial_replicas" if config.autoscaling else "--replicas"
        fixes = ["serve on CPU (--device cpu)"] if kind == "GPU" and have == 0 else []
        if replicas > 1:
            fixes.append(f"serve fewer replicas ({count})")
        if kind == "CPU":
            fixes.append("give each rank fewer cores (num_cpus_per_replica in a config file)")
        fixes.append("join a cluster that has them (--address)")
        raise ValueError(
            f"{replicas} replica(s){shape} with device={config.engine.device} need {need:g} {kind}{'' if need == 1 else 's'} "
            f"({tp * each:g} each), but the local Ray cluster has {have:g}: " + ", or ".join(fixes)
        )
