"""Where prompt prefixes live: the request router's own record of which replica it sent which
prefix blocks to, for cache-aware routing (``router/routing/policy.py``).

The approach of SGLang's router (``sgl-router``, cache-aware policy): the router keeps an
*approximate* picture of each replica's prefix cache, built only from the prompts it routed there,
instead of asking the replicas. Here the picture is a set of block hashes per replica, the same
chained hashes the replica's block manager caches full KV blocks under
(:mod:`replica.protocol.prefix_hash`, vLLM v1's scheme), so "the first ``k`` hashes of a prompt are in a
replica's record" means "that replica was sent a prompt starting with the same ``k`` blocks".

Each replica's record is an LRU bounded by that replica's KV pool (``num_total_blocks`` from its
routing stats): a replica cannot cache more blocks than it has, and its own cache evicts the
least recently freed block first. A prompt's hashes enter the record last-block-first, so its
leading blocks (shared by more prompts) are the most recent and the last to be evicted, as in the
replica, whose freed blocks join its free list tail-first.

A request's hashes come with it: the ingress computes them once per prompt into the envelope's
routing hints (``replica.protocol.envelope.RoutingHints``), which the policy reads.

It is approximate: the replica may have evicted blocks the record still holds (other callers'
traffic, KV pressure), and the record does not see other ingresses' requests. A wrong guess costs
only the prefill the cache would have saved; seats and KV room are checked by the policy anyway.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Hashable, Sequence

from replica.protocol.prefix_hash import ROOT, block_hashes

DEFAULT_CAPACITY_BLOCKS = 4096
"""Blocks a replica's record holds before the replica has reported ``num_total_blocks``."""

MAX_PENDING = 4096
"""Routed requests whose hashes wait for Serve's confirmation of their replica, at most (older
ones are dropped: a request Serve never dispatched)."""


class PrefixAffinity:
    """Per replica, an LRU set of the prefix block hashes this router has sent there.

    Args:
        default_capacity: blocks a replica's record holds until :meth:`set_capacity` is called.

    Costs: O(hashes given) per call (``retain``: O(replicas recorded)); nothing blocks or does
    I/O. Hashing a prompt (:meth:`hashes`) is one SHA-256 per block (measured:
    ``docs/bench/prefix-caching.md``, "What hashing a prompt costs the router").
    """

    def __init__(self, default_capacity: int = DEFAULT_CAPACITY_BLOCKS) -> None:
        self.default_capacity = max(1, int(default_capacity))
        self._records: dict[Hashable, OrderedDict[bytes, None]] = {}
        self._capacity: dict[Hashable, int] = {}
        # Hashes of requests being routed, by request key, until :meth:`confirm` records them.
        self._pending: OrderedDict[Hashable, list[bytes]] = OrderedDict()

    # ---- hashes ------------------------------------------------------------------------------
    @staticmethod
    def hashes(prompt: Sequence[int] | None, block_size: int, root: bytes = ROOT) -> list[bytes]:
        """The chained hashes of the prompt's full blocks (:func:`replica.protocol.prefix_hash.block_hashes`);
        empty for no prompt or one shorter than a block. ``root``: the chain's start, the request's
        LoRA adapter's (``LoRARequest.hash_root``) for an adapter request, as the replica hashes it,
        so a prefix matches only where it was sent under the same adapter."""
        if not prompt or block_size < 1:
            return []
        return block_hashes(prompt, block_size, root)

    # ---- per-replica records -----------------------------------------------------------------
    def capacity(self, replica: Hashable) -> int:
        """Blocks ``replica``'s record holds at most."""
        return self._capacity.get(replica, self.default_capacity)

    def set_capacity(self, replica: Hashable, num_blocks: int) -> None:
        """Bound ``replica``'s record to ``num_blocks`` blocks (its KV pool), evicting the least
        recently sent ones if it holds more. Ignored for ``num_blocks`` < 1 (not reported yet)."""
        if num_blocks < 1 or self._capacity.get(replica) == num_blocks:
            return
        self._capacity[replica] = num_blocks
        record = self._records.get(replica)
        while record is not None and len(record) > num_blocks:
            record.popitem(last=False)

    def match(self, replica: Hashable, hashes: Sequence[bytes]) -> int:
        """How many leading ``hashes`` are in ``replica``'s record (blocks; times the block size
        for tokens). Changes nothing."""
        record = self._records.get(replica)
        if not record:
            return 0
        n = 0
        for h in hashes:
            if h not in record:
                break
            n += 1
        return n

    def record(self, replica: Hashable, hashes: Sequence[bytes]) -> None:
        """Note that a prompt with these block hashes was sent to ``replica``: they become its most
        recent entries (the first hash most recent of all); the least recent ones beyond its
        capacity are dropped."""
        if not hashes:
            return
        record = self._records.setdefault(replica, OrderedDict())
        for h in reversed(hashes):
            record[h] = None
            record.move_to_end(h)
        limit = self.capacity(replica)
        while len(record) > limit:
            record.popitem(last=False)

    def forget(self, replica: Hashable) -> None:
        """Drop everything about ``replica`` (it died: its cache is gone with it)."""
        self._records.pop(replica, None)
        self._capacity.pop(replica, None)

    def retain(self, replicas: Collection[Hashable]) -> None:
        """Forget the replicas not in ``replicas`` (the current ones: others were removed)."""
        if any(r not in replicas for r in self._records):
            for r in [r for r in self._records if r not in replicas]:
                self.forget(r)

    def size(self, replica: Hashable) -> int:
        """Blocks in ``replica``'s record now."""
        return len(self._records.get(replica, ()))

    # ---- requests being routed ---------------------------------------------------------------
    def pending(self, key: Hashable) -> list[bytes] | None:
        """The hashes stored for a request being routed (None if none were)."""
        return self._pending.get(key)

    def hold(self, key: Hashable, hashes: list[bytes]) -> None:
        """Keep a request's hashes until its replica is known (:meth:`confirm`); the oldest held
        request is dropped past :data:`MAX_PENDING`."""
        self._pending[key] = hashes
        self._pending.move_to_end(key)
        while len(self._pending) > MAX_PENDING:
            self._pending.popitem(last=False)

    def discard(self, key: Hashable) -> None:
        """Drop a request's held hashes without recording them."""
        self._pending.pop(key, None)

    def confirm(self, key: Hashable, replica: Hashable) -> bool:
        """The request ``key`` was dispatched to ``replica``: record its held hashes there.
        Returns False if no hashes were held for it (never held, or confirmed already)."""
        hashes = self._pending.pop(key, None)
        if hashes is None:
            return False
        self.record(replica, hashes)
        return True
