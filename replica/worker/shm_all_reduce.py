"""The all-reduce of a CPU tensor-parallel group through shared memory, instead of gloo.

gloo sums over loopback TCP, each call handed from the calling thread to gloo's own threads and
back on every rank; on a few cores that are all busy computing, those hand-offs cost more than
the arithmetic the ranks share (``docs/bench/tensor-parallel-cpu.md``). The ranks of a CPU
replica share one host, so :class:`ShmAllReduce` has each rank copy its partial sum into its slot
of one shared buffer, publish the call's sequence number, wait (spinning, then yielding) until
every rank has published it, and add the slots in rank order: every rank computes the same sum,
bit for bit. Slots alternate between two halves by call parity, so a rank writes call ``s + 1``
only into the half its peers finished reading at call ``s - 1`` (each publishes ``s`` after it has
read call ``s - 1``). Stores on x86-64 are seen by other cores in program order, so a published
number guarantees the slot's data (the module is not used elsewhere: :func:`available`).

The row-wise layers call it through the custom op ``carpool::shm_all_reduce``, which
``torch.compile`` keeps in the graph as one opaque call (:func:`replica.worker.parallel.install_forwards`).
"""

from __future__ import annotations

import os
import platform
import time

import torch

# Spins before each yield of the CPU while waiting for a peer (a peer computing its own share
# arrives within microseconds to a millisecond; yielding lets the host's other threads run).
SPINS_PER_YIELD = 256
# Seconds a rank waits for a peer before it raises (a rank that hangs), and how often a waiting
# rank 0 checks that the others still run (one that died ends the wait at once).
TIMEOUT_S = 60.0
CHECK_EVERY_S = 0.05
_FLAG_BYTES = 64  # one cache line per rank's sequence number
SUM, GATHER = 0, 1  # the C++ op's collectives

_reducers: dict[int, ShmAllReduce] = {}


def available() -> bool:
    """Shared-memory files and x86-64's store ordering (see the module docstring)."""
    return os.path.isdir("/dev/shm") and platform.machine() in ("x86_64", "AMD64")


def buffer_bytes(world_size: int, max_bytes: int) -> int:
    """Size of the shared file: a sequence number per rank, then two halves of a slot per rank."""
    return _FLAG_BYTES * world_size + 2 * world_size * max_bytes


class ShmAllReduce:
    """Sum tensors of up to ``max_bytes`` over ``world_size`` ranks of one host.

    Args:
        rank, world_size: this rank and the group's size.
        path: the shared file (``/dev/shm/...``) of :func:`buffer_bytes` bytes, made by rank 0
            before any rank opens it (the caller orders that, and unlinks it once all have: the
            mappings stay).
        max_bytes: the largest tensor a call sums through the shared buffer.
        peers_alive: rank 0's check that the other ranks still run (``TPGroup.ranks_alive``).
    Raises:
        RuntimeError: (from torch) the file cannot be mapped.
    """

    def __init__(self, rank: int, world_size: int, path: str, max_bytes: int, peers_alive=None) -> None:
        self.rank, self.world_size, self.max_bytes = rank, world_size, max_bytes
        self.peers_alive = peers_alive
        size = buffer_bytes(world_size, max_bytes)
        self.buffer = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        self.flags = self.buffer[: _FLAG_BYTES * world_size].view(torch.int64).view(world_size, -1)[:, 0]
        self.slots = self.buffer[_FLAG_BYTES * world_size :].view(2, world_size, max_bytes)
        self.seq = 0
        # The C++ op (replica/kernels/csrc/cpu_shm_all_reduce.cpp): the same protocol and sums
        # without Python in the wait; the Python path below where the kernels are not built.
        from replica.kernels import cpu_kernels

        self.native = cpu_kernels.load()
        self.key = id(self)
        _reducers[self.key] = self

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` (any shape and dtype) over the ranks, as a new tensor; a tensor
        larger than ``max_bytes`` (a long prefill chunk) is summed by the default group (gloo).

        Raises:
            TimeoutError: a peer has not published this call within :data:`TIMEOUT_S`.
            RuntimeError: ``peers_alive`` says a rank has ended.
        """
        nbytes = x.numel() * x.element_size()
        if nbytes > self.max_bytes:  # every rank takes this path for the same call
            total = x.contiguous().clone()
            torch.distributed.all_reduce(total)
            return total
        self.seq += 1
        if self.native:
            return self._native(x, SUM)
        seq, half = self.seq, self.slots[self.seq % 2]
        half[self.rank, :nbytes].view(x.dtype).view(x.shape).copy_(x.contiguous())
        self.flags[self.rank] = seq
        for peer in range(self.world_size):
            if peer != self.rank:
                self._wait(peer, seq)
        parts = [half[r, :nbytes].view(x.dtype).view(x.shape) for r in range(self.world_size)]
        total = parts[0].clone()
        for part in parts[1:]:
            total.add_(part)
        return total

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """``x`` of every rank concatenated along the last dimension, in rank order, on rank 0; on
        the other ranks, which publish their part and go on without waiting (only rank 0 samples
        from the gathered logits), an uninitialized tensor of that shape. None on every rank when
        the tensor is larger than a slot or the C++ op is not built: the caller then gathers
        through the process group.

        A rank writes call ``s + 2`` into this call's half only once every peer has published
        ``s + 1``, that is, has read call ``s`` (the C++ op checks before it writes).

        Raises: as :meth:`__call__`.
        """
        nbytes = x.numel() * x.element_size()
        if nbytes > self.max_bytes or not self.native:
            return None
        self.seq += 1
        out = self._native(x, GATHER)
        if self.rank != 0:  # published: rank 0 samples from the gathered logits, these are not read
            return x.new_empty(*x.shape[:-1], x.shape[-1] * self.world_size)
        return out

    def _native(self, x: torch.Tensor, op: int) -> torch.Tensor:
        """Call ``self.seq`` through the C++ op, checking between waits of :data:`CHECK_EVERY_S`
        that the peers still run."""
        call = torch.ops.carpool_cpu.shm_collective
        out = call(x, self.buffer, self.rank, self.world_size, self.seq, self.max_bytes, True, CHECK_EVERY_S, op)
        waited = 0.0
        while out.numel() == 0 and x.numel() > 0:
            waited += CHECK_EVERY_S
            if waited > TIMEOUT_S:
                raise TimeoutError(f"a tensor-parallel rank did not reach all-reduce {self.seq} in {TIMEOUT_S:g} s")
            if self.peers_alive is not None and not self.peers_alive():
                raise RuntimeError(f"a tensor-parallel rank has ended (all-reduce {self.seq})")
            published = int(self.flags[self.rank]) >= self.seq  # the op waits for the half to be free first
            out = call(x, self.buffer, self.rank, self.world_size, self.seq, self.max_bytes, not published, CHECK_EVERY_S, op)
        return out

    def _wait(self, peer: int, seq: int) -> None:
        deadline = next_check = None
        spins = 0
        while int(self.flags[peer]) < seq:
            spins += 1
            if spins % SPINS_PER_YIELD == 0:
                now = time.monotonic()
                if deadline is None:
                    deadline, next_check = now + TIMEOUT_S, now + CHECK_EVERY_S
                elif now > deadline:
                    raise TimeoutError(f"tensor-parallel rank {peer} did not reach all-reduce {seq} in {TIMEOUT_S:g} s")
                elif now > next_check and self.peers_alive is not None:
                    if not self.peers_alive():
                        raise RuntimeError(f"tensor-parallel rank {peer} has ended (all-reduce {seq})")
                    next_check = now + CHECK_EVERY_S
                time.sleep(0)


@torch.library.custom_op("carpool::shm_all_reduce", mutates_args=())
def shm_all_reduce(x: torch.Tensor, key: int) -> torch.Tensor:
    """``x`` summed over the ranks by the :class:`ShmAllReduce` registered as ``key``."""
    return _reducers[key](x)


@shm_all_reduce.register_fake
def _(x, key):
    return torch.empty_like(x)


@torch.library.custom_op("carpool::shm_gather", mutates_args=())
def shm_gather(x: torch.Tensor, key: int, world_size: int) -> torch.Tensor:
    """``x`` ``[..., n]`` of every rank joined along the last dimension (``[..., n * world_size]``)
    on rank 0, by the :class:`ShmAllReduce` registered as ``key``; on the other ranks a tensor of
    that shape whose values are not used. Through the process group where the shared buffer
    cannot take it."""
    out = _reducers[key].gather(x)
    if out is not None:
        return out
    parts = [torch.empty_like(x) for _ in range(world_size)]
    torch.distributed.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


@shm_gather.register_fake
def _(x, key, world_size):
    return x.new_empty(*x.shape[:-1], x.shape[-1] * world_size)
