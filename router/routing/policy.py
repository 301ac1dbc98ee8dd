"""Request routing: rank replicas by free seats, waiting requests and free KV blocks, and among
those with a free seat prefer the one most likely to hold the prompt's prefix in its KV cache.

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

**Priority-aware load.** Under the ``priority`` scheduling policy a replica reports how many of
its requests have each priority (``priority_counts``), and a request's *load* on it counts only
those it would not overtake: priority ``<=`` its own, plus this router's requests in flight there
that the report does not hold yet (:func:`~router.routing.ranking.priority_load`). So a request of
high priority goes to the replica where it starts soonest: one busy with low-priority requests,
which it would preempt, ranks as if those seats were free. Under ``fcfs`` (no counts reported)
the load is every request.

**Cache-aware routing** (``prefix_aware=True``, the default; SGLang router's cache-aware policy
with its load-balance guard). When the best tier is 0 or 1 (a free seat), the replica whose record
holds the longest run of the prompt's leading block hashes goes first, if that run is long enough
(below): its prefix cache most likely still has those KV blocks, so their prefill is skipped. The record
(:class:`~router.routing.prefix_affinity.PrefixAffinity`) is this router's own: the block hashes of every
prompt it sent to each replica, an LRU bounded by the replica's KV pool; a prompt enters it when
Serve confirms the replica (``on_request_routed``). Rules, in order:

* only replicas of the best tier compete (so never one without a free seat while another has
  one, and tier 1 only when no replica is in tier 0);
* a match counts only if it covers at least ``prefix_min_match_fraction`` of the prompt's full
  blocks (SGLang's ``cache_threshold``, same default 0.3): a new conversation that shares only a
  short system prompt with earlier ones is placed by load, so new conversations spread evenly
  instead of following the first replica that saw the system prompt. A continuation (a
  Responses follow-up by ``previous_response_id``: ``RoutingHints.continuation``) counts any
  match: its leading blocks are its own conversation's, and after short prompts with long
  replies they are less than that fraction of the follow-up's prompt;
* bounded imbalance: a replica whose load exceeds the least loaded one's of that tier by more
  than ``max(prefix_balance_abs_threshold, prefix_balance_rel_threshold * seats)`` requests does
  not compete on its match, so a hot prefix does not pile onto one replica while others idle;
* ties on the longest match: power of two choices among the tied replicas; no match that counts
  (or no prompt: other calls, prompts shorter than a block): power of two choices as above.

**Adapter-aware routing** (``lora_aware=True``, the default). A LoRA request (its envelope's
``routing.adapter`` names one) prefers, among the replicas of the best tier (a free seat) within the
same imbalance bound, those that hold its adapter in a device slot most surely
(:class:`~router.routing.lora_affinity.LoRAAffinity`: first where this router has requests of it
in flight, counted from the moment it chose their replica; then where its record of the last
``max_loras`` distinct adapters it sent to each replica, or the replica's own report, has it);
cache-aware routing then applies among them, on prompt hashes chained from the adapter's own root
(``LoRARequest.hash_root``; the ingress computes them: ``RoutingHints.of``). A replica that must load the adapter
first pays for it, and may have to wait until one of its slots is free of running requests; so a
request follows its adapter unless that replica is past the imbalance bound, and a hot adapter
spreads to a second replica once the first is loaded. Nobody holding it: a replica with a slot that
none of this router's requests in flight uses (so the adapter is loaded at once, and evicts no
adapter in use), else the load decides.

Why not Serve's model multiplexing (``@serve.multiplexed``, ``multiplexed_model_id``), which
routes by model id: its router would rank replicas by which ids they hold alone, bypassing this
router's free seats, KV room and prefix ranking, and it loads models inside the deployment's own
code per id, while here the engine loads adapters itself, per request, and the seat and KV ranking
must stay first.

With several ingress replicas, each router keeps its own record and sees only its own traffic.
Serve hands a chosen replica to the oldest pending request (``FIFOMixin``), which, when several
requests are being routed at once, may not be the one it was chosen for; the record follows where
each request really went (``on_request_routed``). A replica chosen for a LoRA request goes to the
oldest pending request of the same adapter instead (:meth:`CarpoolRequestRouter._get_pending_request_matching_metadata`),
so that a replica chosen for holding an adapter serves that adapter. Matching by request id instead (Serve's
default) left fanned-out requests (``n`` > 1) unrouted in Ray 2.60, spinning the router.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict, deque
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from router.routing.lora_affinity import DEFAULT_MAX_LORAS, LoRAAffinity
from router.routing.pending import envelope_of, request_key
from router.routing.prefix_affinity import PrefixAffinity
from router.routing.ranking import (  # noqa: F401  (re-exported: the policy's names)
    LOW_KV_FRACTION,
    PREFIX_BALANCE_ABS_THRESHOLD,
    PREFIX_BALANCE_REL_THRESHOLD,
    PREFIX_MIN_MATCH_FRACTION,
    rank_replicas,
    replica_key,
)

RESERVATION_TTL_S = 1.0
"""How long a replica chosen for a request counts it as load before Serve reports it sent there
(seconds). Serve routes the ``n`` choices of one request concurrently: without reservations
every choice would see the same idle replica and pile onto it. A reservation that Serve did not
use (it fell back to another replica) lapses after this time."""

class CarpoolRequestRouter(FIFOMixin, RequestRouter):
    """Rank replicas by free seats, then waiting requests, then free KV blocks; among the
    best-ranked within the imbalance bound, those holding the request's LoRA adapter, then the
    longest prompt-prefix match, else power of two choices (see the module docstring)."""

    def initialize_state(
        self,
        low_kv_fraction: float = LOW_KV_FRACTION,
        prefix_aware: bool = True,
        prefix_balance_abs_threshold: float = PREFIX_BALANCE_ABS_THRESHOLD,
        prefix_balance_rel_threshold: float = PREFIX_BALANCE_REL_THRESHOLD,
        prefix_min_match_fraction: float = PREFIX_MIN_MATCH_FRACTION,
        lora_aware: bool = True,
        max_loras: int = DEFAULT_MAX_LORAS,
        **kwargs,
    ) -> None:
        """Serve calls this with ``request_router_kwargs``.

        Args:
            low_kv_fraction: see :data:`LOW_KV_FRACTION`.
            prefix_aware: prefer the free-seat replica holding the longest prefix of the prompt
                (``ServeConfig.prefix_aware_routing``); False ranks on load alone.
            prefix_balance_abs_threshold: requests; see :data:`PREFIX_BALANCE_ABS_THRESHOLD`.
            prefix_balance_rel_threshold: fraction of seats; see
                :data:`PREFIX_BALANCE_REL_THRESHOLD`.
            prefix_min_match_fraction: fraction of the prompt's full blocks; see
                :data:`PREFIX_MIN_MATCH_FRACTION`.
            lora_aware: prefer the free-seat replicas holding a LoRA request's adapter
                (``ServeConfig.lora_aware_routing``); False ignores adapters.
            max_loras: adapters a replica holds in device slots (``EngineConfig.max_loras``): the
                size of each replica's adapter record.
        """
        self.low_kv_fraction = low_kv_fraction
        self.prefix_aware = bool(prefix_aware)
        self.prefix_balance_abs_threshold = float(prefix_balance_abs_threshold)
        self.prefix_balance_rel_threshold = float(prefix_balance_rel_threshold)
        self.prefix_min_match_fraction = float(prefix_min_match_fraction)
        self.affinity = PrefixAffinity()
        self.lora_aware = bool(lora_aware)
        self.loras = LoRAAffinity(max_loras)
        self._routed_hook_seen = False  # Serve has called on_request_routed (its handshake is on)
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
        if self._routed_hook_seen:  # Serve reports accepted requests: this one was recorded then,
            self.affinity.discard(internal_request_id)  # or was rejected (its retry holds anew)
            self.loras.discard(internal_request_id)
        else:  # a caller without Serve's queue-length handshake: record it now (its blocks stay cached)
            self.affinity.confirm(internal_request_id, replica_id)
            self.loras.confirm(internal_request_id, replica_id)
        self.loras.finish(internal_request_id)
        if self._outstanding.get(replica_id, 0) > 0:
            self._outstanding[replica_id] -= 1

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        # Serve's new replica set (a scale-up or scale-down, a replacement): forget the removed
        # replicas' counts and records (a replica scaled down takes its prefix cache with it).
        super().update_replicas(replicas)
        current = {r.replica_id for r in replicas}
        for table in (self._outstanding, self._reserved):
            for gone in [r for r in table if r not in current]:
                del table[gone]
        self.affinity.retain(current)
        self.loras.retain(current)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._outstanding.pop(replica_id, None)
        self._reserved.pop(replica_id, None)
        self.affinity.forget(replica_id)  # its prefix cache died with it
        self.loras.forget(replica_id)

    def _get_pending_request_matching_metadata(self, request_metadata: Any = None) -> PendingRequest | None:
        """Serve's hook (``FIFOMixin``): the pending request a replica chosen for
        ``request_metadata``'s request goes to. For a LoRA request (adapter-aware routing on),
        the oldest pending request of the same adapter, if any; otherwise None, and Serve hands
        the replica to the oldest pending request."""
        if not self.lora_aware or request_metadata is None:
            return None
        name = self.loras.pending(request_metadata.internal_request_id)
        if name is None:
            return None
        for pending_request in self._pending_requests_to_fulfill:
            envelope = envelope_of(pending_request)
            if not pending_request.future.done() and envelope is not None and envelope.routing.adapter == name:
                return pending_request
        return None

    # ---- where prompts went (cache-aware routing) ------------------------------------------------
    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        # Serve calls this when a replica accepted the request (its queue-length handshake).
        super().on_request_routed(pending_request, replica_id, result)
        self._routed_hook_seen = True
        self.affinity.confirm(request_key(pending_request), replica_id)
        self.loras.confirm(request_key(pending_request), replica_id)

    def _prompt_hashes(self, pending_request: PendingRequest | None) -> list[bytes]:
        """The block hashes of the request's prompt (its envelope's ``routing.prefix_hashes``,
        held until Serve confirms its replica), or [] for another call, a prompt shorter than a
        block, or cache-aware routing off. Raises what :func:`~router.routing.pending.envelope_of` raises."""
        envelope = envelope_of(pending_request)
        if not self.prefix_aware or envelope is None or not envelope.routing.prefix_hashes:
            return []
        hashes = list(envelope.routing.prefix_hashes)
        self.affinity.hold(request_key(pending_request), hashes)
        return hashes

    def _adapter_places(
        self, candidates: list[RunningReplica], pending_request: PendingRequest | None
    ) -> tuple[list[int], list[bool]] | tuple[None, None]:
        """Per candidate, how surely it holds the request's LoRA adapter (0 to 2:
        :meth:`~router.routing.lora_affinity.LoRAAffinity.holds`; 3 more for the adapter's home,
        :meth:`~router.routing.lora_affinity.LoRAAffinity.home`), and whether it has a slot no
        request of this router uses (fewer than ``max_loras`` adapters in flight there);
        ``(None, None)`` for a base-model request, another call, or adapter-aware routing off.
        Holds the adapter until Serve confirms the request's replica."""
        envelope = envelope_of(pending_request)
        name = envelope.routing.adapter if envelope is not None else None
        if not self.lora_aware or name is None:
            return None, None
        self.loras.hold(request_key(pending_request), name)
        self.loras.retain(self.curr_replicas)
        self.loras.expire(time.monotonic())
        holds = [self.loras.holds(name, r.replica_id, (r.routing_stats or {}).get("lora_loaded")) for r in candidates]
        home = self.loras.home(name, list(self.curr_replicas), [r.replica_id for r, h in zip(candidates, holds) if h])
        holds = [h + 3 * (r.replica_id == home) for h, r in zip(holds, candidates)]  # home first, then where held
        free = [self.loras.active(r.replica_id) < self.loras.max_loras for r in candidates]
        return holds, free

    def max_imbalance(self, candidates: list[RunningReplica]) -> float:
        """Requests by which a replica's load may exceed the least loaded one's and still win on
        its prefix match: ``max(abs threshold, rel threshold * seats)``."""
        slots = max((int((r.routing_stats or {}).get("num_slots") or 0) for r in candidates), default=0)
        return max(self.prefix_balance_abs_threshold, self.prefix_balance_rel_threshold * slots)

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

    def key(self, replica: RunningReplica, priority: int | None = None) -> tuple[int, int, int, int]:
        """:func:`~router.routing.ranking.replica_key` of ``replica`` for a request of ``priority``."""
        return replica_key(replica.routing_stats or {}, self.live_load(replica), self.low_kv_fraction, priority)

    # ---- the policy ------------------------------------------------------------------------------
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        envelope = envelope_of(pending_request)
        priority = envelope.priority if envelope is not None else None
        keyed = [(self.key(r, priority), r) for r in candidate_replicas]
        hashes = self._prompt_hashes(pending_request)
        holds, slot_free = self._adapter_places(candidate_replicas, pending_request)
        matches, min_match = None, 1
        if hashes:
            affinity = self.affinity
            for r in candidate_replicas:
                affinity.set_capacity(r.replica_id, int((r.routing_stats or {}).get("num_total_blocks") or 0))
            affinity.retain(self.curr_replicas)
            matches = [affinity.match(r.replica_id, hashes) for r in candidate_replicas]
            continuation = envelope is not None and envelope.routing.continuation
            min_match = 1 if continuation else max(1, math.ceil(self.prefix_min_match_fraction * len(hashes) - 1e-9))
        if matches is not None or holds is not None:
            ranks = rank_replicas(keyed, matches, self.max_imbalance(candidate_replicas), min_match, holds, slot_free)
        else:
            ranks = rank_replicas(keyed)
        if ranks:
            # Serve tries the first group (one replica) first: count the request there at once.
            now = time.monotonic()
            self._reserved[ranks[0][0].replica_id].append(now)
            if holds is not None:
                self.loras.place(request_key(pending_request), ranks[0][0].replica_id, now)
        return ranks
