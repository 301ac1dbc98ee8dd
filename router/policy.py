"""Request routing: rank replicas by free seats, waiting requests and free KV blocks.

A Ray Serve ``RequestRouter`` (``ray.serve.request_router``), running inside every caller of the
replica deployment (the ingress). For each request Serve asks
:meth:`CarpoolRequestRouter.choose_replicas` for ranked groups of replicas, tries the first group
(taking its member with the fewest ongoing requests that is under ``max_ongoing_requests``) and
falls back to the next group otherwise.

Load information, three sources:

* ``routing_stats``: what each replica's ``record_routing_stats()`` reports (seats =
  ``max_num_seqs``, running, waiting, free and total KV blocks), polled by Serve's controller
  every ``request_routing_stats_period_s``: complete, but up to a period old;
* this router's own count of requests it has sent to each replica and not yet seen complete:
  exact and instant for its own traffic (so a burst does not pile onto one replica between two
  stats polls);
* Serve's queue-length cache: the replica's ongoing requests as last reported to this router
  (includes other callers' requests; it lags for requests still in transit).
* reservations: a replica ranked first counts the request at once, before Serve reports it sent
  (:data:`RESERVATION_TTL_S`), so the ``n`` choices of one request, routed concurrently, spread
  over the replicas instead of all seeing the same idle one.

A replica's *load* (engine requests running or waiting; each ongoing Serve request is one engine
request) is the larger of the two live counts, or the reported running + waiting when neither is
known. Its free seats are ``num_slots - load``. Ranking, best first:

0. a free seat and free KV blocks: the request starts at the replica's next step;
1. a free seat but a nearly full KV pool (it would wait for blocks or cause preemptions);
2. no free seat: fewest waiting requests first.

Among the replicas of the best tier (in tier 2: those with the fewest waiting), *power of two
choices* (Mitzenmacher 2001): two at random, the less loaded one first (ties broken at random).
The others follow in rank order as fallbacks. So a replica without a free seat is never chosen
while another one has one, and equally loaded replicas share a burst evenly.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict, deque
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

LOW_KV_FRACTION = 0.05
"""A replica whose free KV blocks fall under this fraction of its pool ranks in tier 1."""

RESERVATION_TTL_S = 1.0
"""How long a replica chosen for a request counts it as load before Serve reports it sent there
(seconds). Serve routes the ``n`` choices of one request concurrently: without reservations
every choice would see the same idle replica and pile onto it. A reservation that Serve did not
use (it fell back to another replica) lapses after this time."""


def replica_key(
    stats: dict[str, Any], live_load: int | None, low_kv_fraction: float = LOW_KV_FRACTION
) -> tuple[int, int, int, int]:
    """Sort key ``(tier, waiting, -free_blocks, load)`` of one replica; smaller is better.

    Tiers: 0 a free seat, 1 a free seat but few free KV blocks, 2 no free seat, 3 a replica that
    reports itself unhealthy (``healthy: False``: its engine loop is dead or wedged).

    Args:
        stats: the replica's last ``routing_stats`` (empty before the first poll).
        live_load: requests in flight to it as this router knows them, or None if unknown.
        low_kv_fraction: below this fraction of free blocks a replica with a free seat drops to
            tier 1.
    """
    reported = int(stats.get("num_running", 0)) + int(stats.get("num_waiting", 0))
    load = live_load if live_load is not None else reported
    slots = int(stats.get("num_slots") or 0)
    total_blocks = int(stats.get("num_total_blocks") or 0)
    free_blocks = int(stats.get("num_free_blocks", total_blocks))
    if stats.get("healthy") is False:  # engine loop dead or wedged: last, until Serve replaces it
        return (3, 0, 0, load)
    if slots == 0:  # no stats yet: only the live load tells replicas apart
        return (0, 0, 0, load)
    if load < slots:
        tier = 1 if total_blocks and free_blocks < low_kv_fraction * total_blocks else 0
        return (tier, 0, -free_blocks, load)
    return (2, load - slots, -free_blocks, load)


class CarpoolRequestRouter(FIFOMixin, RequestRouter):
    """Rank replicas by free seats, then waiting requests, then free KV blocks; power of two
    choices among the best-ranked (see the module docstring)."""

    def initialize_state(self, low_kv_fraction: float = LOW_KV_FRACTION, **kwargs) -> None:
        """Serve calls this with ``request_router_kwargs``."""
        self.low_kv_fraction = low_kv_fraction
        self._outstanding: dict[ReplicaID, int] = defaultdict(int)
        # Monotonic times at which a replica was ranked first and not yet sent that request.
        self._reserved: dict[ReplicaID, deque[float]] = defaultdict(deque)

    # ---- this router's exact count of requests in flight per replica ---------------------------
    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        self._outstanding[replica_id] += 1
        reserved = self._reserved.get(replica_id)
        if reserved:
            reserved.popleft()  # the request it was reserved for (or an equivalent one) is sent

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        # Serve calls this exactly once per dispatched request (finished, failed, cancelled or
        # rejected by a full replica).
        super().on_request_completed(replica_id, internal_request_id)
        if self._outstanding.get(replica_id, 0) > 0:
            self._outstanding[replica_id] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._outstanding.pop(replica_id, None)
        self._reserved.pop(replica_id, None)

    def _num_reserved(self, replica_id: ReplicaID, now: float) -> int:
        reserved = self._reserved.get(replica_id)
        if not reserved:
            return 0
        while reserved and now - reserved[0] > RESERVATION_TTL_S:
            reserved.popleft()
        return len(reserved)

    def live_load(self, replica: RunningReplica) -> int | None:
        """max(this router's outstanding plus reserved requests, Serve's cached queue length),
        None if neither is known."""
        cached = self.replica_queue_len_cache.get(replica.replica_id)
        mine = self._outstanding.get(replica.replica_id, 0) + self._num_reserved(replica.replica_id, time.monotonic())
        if cached is None and not mine:
            return None
        return max(cached or 0, mine)

    def key(self, replica: RunningReplica) -> tuple[int, int, int, int]:
        return replica_key(replica.routing_stats or {}, self.live_load(replica), self.low_kv_fraction)

    # ---- the policy ------------------------------------------------------------------------------
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        ranks = rank_replicas([(self.key(r), r) for r in candidate_replicas])
        if ranks:
            # Serve tries the first group (one replica) first: count the request there at once.
            self._reserved[ranks[0][0].replica_id].append(time.monotonic())
        return ranks


def rank_replicas(keyed: list[tuple[tuple[int, int, int, int], Any]]) -> list[list[Any]]:
    """Ranked groups from ``(key, replica)`` pairs (see :func:`replica_key`): first the power-of-two
    winner alone, then the other sampled one, then the rest by tier."""
    if not keyed:
        return []
    order = sorted(keyed, key=lambda kr: (kr[0], random.random()))
    best_tier, best_waiting = order[0][0][0], order[0][0][1]
    best = [kr for kr in order if kr[0][0] == best_tier and kr[0][1] == best_waiting]
    pair = random.sample(best, 2) if len(best) >= 2 else best
    pair.sort(key=lambda kr: (kr[0][3], kr[0][2], random.random()))  # fewer requests, then more free blocks
    ranks = [[kr[1]] for kr in pair]
    chosen = {id(kr[1]) for kr in pair}
    for tier in (0, 1, 2):
        group = [kr[1] for kr in order if kr[0][0] == tier and id(kr[1]) not in chosen]
        if group:
            ranks.append(group)
    return ranks
