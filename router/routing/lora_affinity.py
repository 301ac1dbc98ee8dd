"""Where LoRA adapters live: which replicas likely hold a request's adapter in a device slot, for
adapter-aware routing (``router/routing/policy.py``).

Two sources, merged (:meth:`LoRAAffinity.holds`), and surest where this router has requests of
the adapter in flight:

* the router's own record: per replica, an LRU of the last ``max_loras`` distinct adapters this
  router sent there (a replica's engine keeps at most ``max_loras`` adapters in device slots and
  replaces the least recently used one, so the record follows it for this router's traffic).
  Exact and instant for its own requests, as the prefix record is (``prefix_affinity.py``); it
  does not see other ingresses' requests;
* what each replica reports (``record_routing_stats()["lora_loaded"]``, the names in its device
  slots): every caller's traffic, but up to a stats period old.

Each adapter also has a *home* replica (:meth:`LoRAAffinity.home`): chosen the first time this
router routes the adapter, the replica whose homed adapters drew the fewest of its requests so
far, and kept while that replica lives. The adapters are so partitioned over the replicas,
weighted by their traffic, so that each replica's slots take turns among its share of the
adapters instead of all of them (with 8 adapters over 2 replicas of 2 slots, "prefer where it
is loaded" alone lets every replica see every rarely used adapter). It is a preference, as the
prefix match is: the imbalance bound of ``policy.py`` still sends a request elsewhere when its
home is too busy.

A request's adapter is its envelope's ``routing.adapter`` (the envelope of its replica call,
``LLMReplica.generate`` or ``generate_all``: ``router/routing/pending.py``), which names one for
adapter requests only.

Held like the prefix record's hashes: a request's adapter is noted when it is routed
(:meth:`LoRAAffinity.hold`) and recorded at the replica Serve confirms (:meth:`LoRAAffinity.confirm`).

The record also counts, per replica, this router's requests in flight by adapter
(:meth:`LoRAAffinity.active`, until :meth:`LoRAAffinity.finish`): a replica whose slots all serve
running requests cannot take another adapter until one of them is done (the request waits), so an
adapter nobody holds goes preferably where fewer than ``max_loras`` adapters are in use. A request
counts from the moment the router chooses its replica (:meth:`LoRAAffinity.place`), not only once
Serve confirms it (a round trip later), so that the requests of a burst, routed before any is
confirmed, see where the ones before them went.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from collections.abc import Collection, Hashable, Iterable

DEFAULT_MAX_LORAS = 4
"""Adapters a replica's record holds (the engine's device slots, ``max_loras``) unless told."""

MAX_PENDING = 4096
"""Routed requests whose adapter waits for Serve's confirmation of their replica, at most."""

PLACE_TTL_S = 1.0
"""How long a request placed on a replica (:meth:`LoRAAffinity.place`) counts in flight there
before Serve confirms where it went (seconds); a placement never confirmed lapses then."""

MAX_IN_FLIGHT = 65536
"""Confirmed requests whose end this record waits for, at most (older ones are dropped: a request
whose end was never reported)."""


class LoRAAffinity:
    """Per replica, an LRU of the adapter names this router sent there, at most ``max_loras``.

    Args:
        max_loras: adapters each replica's record holds (the engine's ``max_loras``).
    """

    def __init__(self, max_loras: int = DEFAULT_MAX_LORAS) -> None:
        self.max_loras = max(1, int(max_loras))
        self._records: dict[Hashable, OrderedDict[str, None]] = {}
        self._pending: OrderedDict[Hashable, str] = OrderedDict()
        self._active: dict[Hashable, Counter[str]] = {}  # replica -> adapter -> requests in flight
        self._in_flight: OrderedDict[Hashable, tuple[Hashable, str]] = OrderedDict()  # request -> (replica, adapter)
        self._placed: OrderedDict[Hashable, float] = OrderedDict()  # request -> when placed, until confirmed
        self._homes: dict[str, Hashable] = {}  # adapter -> its home replica
        self._traffic: Counter[str] = Counter()  # adapter -> requests routed so far

    def home(self, name: str, replicas: Collection[Hashable], holding: Collection[Hashable] = ()) -> Hashable | None:
        """Adapter ``name``'s home among ``replicas`` (see the module docstring): kept while it is
        one of them, else, among those ``holding`` it already if any, the replica whose homed
        adapters drew the fewest requests (ties broken by a hash of the adapter and the replica).
        None when there is no replica."""
        home = self._homes.get(name)
        if home in replicas:
            return home
        replicas = [r for r in replicas if r in holding] or list(replicas)
        if not replicas:
            return None
        drawn: Counter[Hashable] = Counter()
        for adapter, replica in self._homes.items():
            drawn[replica] += self._traffic[adapter]

        def tie(replica: Hashable) -> bytes:
            return hashlib.sha256(f"{name}\0{replica}".encode()).digest()

        home = min(replicas, key=lambda r: (drawn[r], tie(r)))
        self._homes[name] = home
        return home

    def record(self, replica: Hashable, name: str) -> None:
        """A request of adapter ``name`` was sent to ``replica``: it becomes the most recent there.
        Past ``max_loras`` names, the least recent one without requests in flight is dropped (the
        engine cannot replace an adapter its running requests use either)."""
        record = self._records.setdefault(replica, OrderedDict())
        record[name] = None
        record.move_to_end(name)
        active = self._active.get(replica, {})
        while len(record) > self.max_loras:
            idle = next((n for n in record if n not in active and n != name), None)
            record.pop(idle if idle is not None else next(iter(record)))

    def recorded(self, replica: Hashable) -> list[str]:
        """``replica``'s record, least recent first."""
        return list(self._records.get(replica, ()))

    def holds(self, name: str, replica: Hashable, reported: Iterable[str] | None) -> int:
        """How surely ``replica`` holds adapter ``name`` in a slot: 2 when requests of this router
        with it are in flight there (a slot serving running requests is never replaced), 1 when it
        is in this router's record or in the replica's own report (``reported``, a stats period
        old), 0 otherwise."""
        if name in self._active.get(replica, ()):
            return 2
        if name in self._records.get(replica, ()) or (reported is not None and name in reported):
            return 1
        return 0

    def active(self, replica: Hashable) -> int:
        """Distinct adapters of this router's requests in flight on ``replica``."""
        return len(self._active.get(replica, ()))

    def forget(self, replica: Hashable) -> None:
        """Drop ``replica``'s record (it died: its slots are gone with it)."""
        self._records.pop(replica, None)
        self._active.pop(replica, None)
        for name in [n for n, home in self._homes.items() if home == replica]:
            del self._homes[name]
        for key in [k for k, (r, _) in self._in_flight.items() if r == replica]:
            del self._in_flight[key]

    def retain(self, replicas: Collection[Hashable]) -> None:
        """Forget the replicas not in ``replicas`` (the current ones)."""
        for r in [r for r in set(self._records) | set(self._active) if r not in replicas]:
            self.forget(r)

    # ---- requests being routed ---------------------------------------------------------------
    def hold(self, key: Hashable, name: str) -> None:
        """Keep a request's adapter until its replica is known (:meth:`confirm`); it counts in
        the adapter's traffic."""
        if key not in self._pending:
            self._traffic[name] += 1
        self._pending[key] = name
        self._pending.move_to_end(key)
        while len(self._pending) > MAX_PENDING:
            self._pending.popitem(last=False)

    def pending(self, key: Hashable) -> str | None:
        """The adapter held for a request being routed (None if none was)."""
        return self._pending.get(key)

    def discard(self, key: Hashable) -> None:
        """Drop a request's held adapter without recording it."""
        self._pending.pop(key, None)

    def place(self, key: Hashable, replica: Hashable, now: float) -> None:
        """The router chose ``replica`` for the held request ``key`` (``now``: ``time.monotonic()``):
        count it in flight there until Serve confirms where it went, for :data:`PLACE_TTL_S` at most."""
        self.expire(now)
        name = self._pending.get(key)
        if name is not None:
            self._count(key, replica, name)
            self._placed[key] = now
            self._placed.move_to_end(key)

    def expire(self, now: float) -> None:
        """End the placements older than :data:`PLACE_TTL_S` that Serve never confirmed."""
        while self._placed and now - next(iter(self._placed.values())) > PLACE_TTL_S:
            self.finish(self._placed.popitem(last=False)[0])

    def confirm(self, key: Hashable, replica: Hashable) -> bool:
        """The request ``key`` was dispatched to ``replica``: record its held adapter there and
        count it in flight there until :meth:`finish`. Returns False if none was held."""
        name = self._pending.pop(key, None)
        if name is None:
            return False
        self._placed.pop(key, None)
        self.record(replica, name)
        self._count(key, replica, name)
        return True

    def _count(self, key: Hashable, replica: Hashable, name: str) -> None:
        """Count request ``key`` in flight on ``replica`` (moved there if counted elsewhere)."""
        self.finish(key)
        self._active.setdefault(replica, Counter())[name] += 1
        self._in_flight[key] = (replica, name)
        while len(self._in_flight) > MAX_IN_FLIGHT:
            self._end(*self._in_flight.popitem(last=False)[1])

    def finish(self, key: Hashable) -> None:
        """The request ``key`` ended (or never ran): it no longer counts in flight."""
        self._placed.pop(key, None)
        ended = self._in_flight.pop(key, None)
        if ended is not None:
            self._end(*ended)

    def _end(self, replica: Hashable, name: str) -> None:
        counts = self._active.get(replica)
        if counts is not None:
            counts[name] -= 1
            if counts[name] <= 0:
                del counts[name]
