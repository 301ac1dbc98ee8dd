"""Ranks 1..N-1 of a tensor-parallel Serve replica, as Ray actors in the replica's placement group.

Serve reserves N bundles for each replica (``placement_group_bundles``, ``STRICT_PACK``: one node;
:func:`cluster.app.replica_deployment_options`); the replica actor (rank 0) takes bundle 0 and
:class:`PlacementGroupLauncher` puts rank ``r`` in bundle ``r``. The rank actors are owned by the
replica actor, so Ray ends them when it dies; a rank's loop ends when rank 0's connection closes
(:func:`replica.worker.tp_worker.run_rank`). When a rank actor dies, its handle says so
(:meth:`RankActorHandle.is_alive`), the replica's health check fails, and Serve replaces the whole
group.
"""

from __future__ import annotations

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from replica.serve.replica_info import node_ip


@ray.remote(max_restarts=0, max_task_retries=0)
class RankActor:
    """One rank: :func:`~replica.worker.tp_worker.run_rank` in this actor's process."""

    def run(self, rank: int, tp_size: int, init_method: str, runner_kwargs: dict, num_threads: int) -> None:
        from replica.serve.logs import log_through_serve
        from replica.worker.tp_worker import run_rank

        log_through_serve()
        run_rank(rank, tp_size, init_method, runner_kwargs, num_threads)


class RankActorHandle:
    """A rank actor and its running ``run`` call (which returns only when the rank ends)."""

    def __init__(self, actor, call) -> None:
        self.actor, self.call = actor, call

    def is_alive(self) -> bool:
        done, _ = ray.wait([self.call], timeout=0)
        return not done

    def kill(self) -> None:
        ray.kill(self.actor, no_restart=True)


class PlacementGroupLauncher:
    """Start ranks 1..N-1 in bundles 1..N-1 of the calling replica's placement group.

    Args:
        num_gpus: GPUs of each rank actor (1 on CUDA, 0 on CPU). A rank actor asks for no CPU: its
            bundle's CPUs are reserved for it, and it runs ``num_threads`` threads.
    Raises:
        RuntimeError: (when called) the replica runs outside a placement group, or the group has
            fewer bundles than ranks.
    """

    def __init__(self, num_gpus: int) -> None:
        self.num_gpus = num_gpus
        self.host = node_ip()

    def __call__(self, init_method: str, tp_size: int, runner_kwargs: dict, num_threads: int) -> list[RankActorHandle]:
        group = get_current_placement_group()
        if group is None or len(group.bundle_specs) < tp_size:
            raise RuntimeError(
                f"tensor_parallel_size {tp_size} needs the replica in a placement group of {tp_size} bundles "
                "(serve it through cluster.app, which reserves them)"
            )
        handles = []
        for rank in range(1, tp_size):
            actor = RankActor.options(
                num_cpus=0, num_gpus=self.num_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank),
            ).remote()
            handles.append(RankActorHandle(actor, actor.run.remote(rank, tp_size, init_method, runner_kwargs, num_threads)))
        return handles
