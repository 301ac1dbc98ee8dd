"""The loop of ranks 1..N-1 of a tensor-parallel replica (``python -m replica.worker.tp_worker``
for a local process, :mod:`replica.serve.tp_ranks` for a Ray actor).

Each builds the same :class:`~replica.worker.model_runner.ModelRunner` as rank 0 on its shard of
the model, then replays, in order, every command rank 0 broadcasts (:data:`RANK_COMMANDS`: the
persistent batch's size, the warm-up, the decode graphs, and each step's forward). Rank 0 alone
schedules, samples and detokenizes. The loop ends on ``None`` (rank 0 closing) or when rank 0
has gone (gloo's connection closes), so a rank never outlives its group. How rank 0 starts the
ranks: :mod:`replica.worker.tp_launch`.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time

import torch

from replica.worker.parallel import init_tp_group

logger = logging.getLogger(__name__)

# Seconds between two looks of a local rank process at whether its parent (rank 0) still runs.
PARENT_CHECK_S = 0.5
# What rank 0 may ask the other ranks to run (ModelRunner methods, called with the same arguments).
RANK_COMMANDS = frozenset({"init_batch", "warm_up", "enable_decode_graphs", "time_forwards", "forward"})


def run_rank(rank: int, tp_size: int, init_method: str, runner_kwargs: dict, num_threads: int) -> None:
    """A rank's whole life: join the group, build its runner, replay rank 0's commands until
    ``None`` or until rank 0 has gone. Raises what a command raises (the group is then broken:
    rank 0 fails too)."""
    torch.set_num_threads(num_threads)
    tp = init_tp_group(rank, tp_size, init_method, torch.device(runner_kwargs["device"]))
    try:
        from replica.worker.model_runner import ModelRunner

        runner = ModelRunner(**runner_kwargs, tp=tp)
        while True:
            try:
                command = tp.broadcast()
            except RuntimeError as exc:  # rank 0 ended without a word: its connections closed
                logger.warning("tensor-parallel rank %d: rank 0 has gone (%s); ending", rank, exc)
                return
            if command is None:
                break
            name, args = command
            if name not in RANK_COMMANDS:
                raise ValueError(f"rank {rank}: unknown command {name!r}")
            getattr(runner, name)(*args)
    finally:
        tp.close()


def _die_with_parent(parent_pid: int) -> None:
    """End this process within :data:`PARENT_CHECK_S` of its parent's end, whatever this process is
    doing then (a thread that watches the parent's pid; the kernel's ``PR_SET_PDEATHSIG`` would
    fire when the parent's *thread* that started this process ends, which may be long before)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_CHECK_S)
        os._exit(1)

    threading.Thread(target=watch, name="carpool-parent-watch", daemon=True).start()


if __name__ == "__main__":
    _die_with_parent(int(sys.argv[1]))
    logging.basicConfig(level=logging.WARNING)
    run_rank(*pickle.loads(sys.stdin.buffer.read()))
