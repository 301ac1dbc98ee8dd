"""How rank 0 of a tensor-parallel replica starts ranks 1..N-1 and joins their process group.

Ranks are started by a *launcher*: a callable ``launch(init_method, tp_size, runner_kwargs,
num_threads) -> handles`` (each handle has ``is_alive()`` and ``kill()``) with a ``host``
attribute, the address the other ranks reach rank 0 at. :class:`ProcessLauncher` (the default: one
local process per rank, as vLLM's ``mp`` executor) serves the offline engine; a Ray Serve replica
passes one that starts Ray actors in its placement group (:mod:`replica.serve.tp_ranks`). Each
rank then runs :func:`replica.worker.tp_worker.run_rank`.
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path

import torch

from replica.worker.parallel import TPGroup, init_tp_group


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s device when all ranks share one host's devices: ``cuda:i`` moves to
    ``cuda:i+rank``; ``cpu`` stays."""
    if not device.startswith("cuda"):
        return device
    base = int(device.partition(":")[2] or 0)
    return f"cuda:{base + rank}"


def start_ranks(tp_size: int, runner_kwargs: dict, launch=None) -> TPGroup:
    """Start ranks 1..``tp_size``-1 with ``launch`` (default :class:`ProcessLauncher`) and join
    their group as rank 0; if joining fails, the started ranks are killed.

    Raises:
        RuntimeError: this process already holds a tensor-parallel group (one engine of
            ``tensor_parallel_size`` > 1 per process: ``close()`` the first), or the ranks do not
            join in time (from :func:`~replica.worker.parallel.init_tp_group`).
    """
    if torch.distributed.is_initialized():
        raise RuntimeError(
            "this process already runs a tensor-parallel engine (one per process): close() it before starting another"
        )
    launch = launch or ProcessLauncher()
    init_method = f"tcp://{launch.host}:{free_port(launch.host)}"
    handles = launch(init_method, tp_size, runner_kwargs, torch.get_num_threads())
    try:
        tp = init_tp_group(0, tp_size, init_method, torch.device(runner_kwargs["device"]))
    except BaseException:
        for handle in handles:
            handle.kill()
        raise
    tp.ranks = handles
    return tp


class RankProcess:
    """A rank run as a child process: ``python -m replica.worker.tp_worker`` reading its arguments
    (pickled) from stdin, so that nothing of the parent's ``__main__`` runs again in it."""

    def __init__(self, args: tuple) -> None:
        root = str(Path(__file__).resolve().parents[2])  # the folder that holds replica/
        paths = [root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "replica.worker.tp_worker", str(os.getpid())], stdin=subprocess.PIPE, env=env
        )
        self.process.stdin.write(pickle.dumps(args))
        self.process.stdin.close()

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        self.process.kill()


class ProcessLauncher:
    """One local child process per rank 1..``tp_size``-1 (vLLM's ``mp`` executor), on the next
    devices (:func:`rank_device`); each ends when this process does (its watch of the parent's pid) or when
    the group breaks."""

    host = "127.0.0.1"

    def __call__(self, init_method: str, tp_size: int, runner_kwargs: dict, num_threads: int) -> list[RankProcess]:
        return [
            RankProcess((rank, tp_size, init_method, dict(runner_kwargs, device=rank_device(runner_kwargs["device"], rank)), num_threads))
            for rank in range(1, tp_size)
        ]


