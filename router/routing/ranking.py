"""Ranking replicas, as plain functions of their stats (no Serve): the sort key of one replica
(:func:`replica_key`: tier, waiting, free KV blocks, load; the load a request of a given
priority sees: :func:`priority_load`) and the ranked groups Serve tries in
order (:func:`rank_replicas`), with the cache-aware and adapter-aware preferences and their
imbalance bound. ``router/routing/policy.py`` (the Serve ``RequestRouter``) explains the policy
and feeds these functions.
"""

from __future__ import annotations

import random
from typing import Any

LOW_KV_FRACTION = 0.05
"""A replica whose free KV blocks fall under this fraction of its pool ranks in tier 1."""

PREFIX_BALANCE_ABS_THRESHOLD = 4
"""Cache-aware routing's imbalance bound, in requests (running + waiting): a replica more loaded
than the least loaded free-seat replica by more than this (or by the relative bound below, if
larger) is not chosen for its prefix match. SGLang's router has the same guard
(``balance_abs_threshold``)."""

PREFIX_BALANCE_REL_THRESHOLD = 0.125
"""The same bound as a fraction of a replica's seats (``max_num_seqs``): 8 requests at 64 seats.
A burst that finds every replica with free seats leans toward the replica its prompts' shared
prefix points at by up to this many requests, and the leaning replica sets the burst's tail
(docs/bench/burst-tail-cpu.md)."""

PREFIX_MIN_MATCH_FRACTION = 0.3
"""Cache-aware routing follows a match only if it covers at least this fraction of the prompt's
full blocks; below it the load decides. SGLang's router has the same rule (``cache_threshold``,
default 0.3)."""


def priority_load(stats: dict[str, Any], priority: int, load: int) -> int:
    """The part of a replica's ``load`` (requests running or waiting there) that a request of
    ``priority`` would not overtake, under the ``priority`` scheduling policy: the requests of
    priority ``<=`` it (lower runs first; equal ones arrived first), from the replica's
    ``priority_counts`` (``[[priority, requests], ...]``; ``replica/serve/deployment.py``), plus
    the requests ``load`` holds beyond what the replica reported (sent since its last report, of
    a priority unknown here: counted as ahead). ``load`` itself when the replica reports no counts
    (the ``fcfs`` policy, where every request waits its turn, or no report yet). A request of
    higher priority may preempt the others, so those are left out."""
    counts = stats.get("priority_counts")
    if not counts:
        return load
    reported = int(stats.get("num_running", 0)) + int(stats.get("num_waiting", 0))
    ahead = sum(int(n) for p, n in counts if int(p) <= priority)
    return ahead + max(0, load - reported)


def replica_key(
    stats: dict[str, Any], live_load: int | None, low_kv_fraction: float = LOW_KV_FRACTION, priority: int | None = None,
) -> tuple[int, int, int, int]:
    """Sort key ``(tier, waiting, -free_blocks, load)`` of one replica; smaller is better.

    Tiers: 0 a free seat, 1 a free seat but few free KV blocks, 2 no free seat, 3 a replica that
    reports itself unhealthy (``healthy: False``: its engine loop is dead or wedged).

    Args:
        stats: the replica's last ``routing_stats`` (empty before the first poll).
        live_load: requests in flight to it as this router knows them, or None if unknown.
        low_kv_fraction: below this fraction of free blocks a replica with a free seat drops to
            tier 1.
        priority: the request's priority (vLLM's: lower runs first), or None: the load is every
            request; else only those it would not overtake (:func:`priority_load`), so that a
            request of high priority goes where it starts soonest.
    """
    reported = int(stats.get("num_running", 0)) + int(stats.get("num_waiting", 0))
    load = live_load if live_load is not None else reported
    if priority is not None:
        load = priority_load(stats, priority, load)
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


def rank_replicas(
    keyed: list[tuple[tuple[int, int, int, int], Any]],
    matches: list[int] | None = None,
    max_imbalance: float = PREFIX_BALANCE_ABS_THRESHOLD,
    min_match: int = 1,
    holds: list[int] | None = None,
    slot_free: list[bool] | None = None,
) -> list[list[Any]]:
    """Ranked groups from ``(key, replica)`` pairs (see :func:`replica_key`): first the chosen
    replica alone, then (power of two choices) the other sampled one, then the rest by tier.

    Args:
        keyed: ``(key, replica)`` pairs.
        matches: per pair, in the same order, the prompt's prefix blocks the replica likely holds
            (cache-aware routing); None for load alone.
        max_imbalance: requests; a replica more loaded than the least loaded one of the best tier
            by more than this does not compete on its match or its adapter.
        min_match: blocks; a shorter match does not count (at least 1).
        holds: per pair, how surely the replica holds the request's LoRA adapter (0: not, 1:
            likely, 2: surely; adapter-aware routing); None for a base-model request or adapters
            ignored. Booleans count as 0 and 1.
        slot_free: per pair (with ``holds``), whether the replica has a LoRA slot that no request
            in flight uses: where an adapter nobody holds can be loaded without waiting.

    The chosen one, when the best tier has a free seat (0 or 1): among that tier's replicas
    within the imbalance bound, those holding the adapter most surely if any do (``holds``), else
    those with a free slot if any (``slot_free``); among those, the longest match if it is at least ``min_match`` blocks (``matches``; ties by power of two
    choices among the tied); otherwise power of two choices among the replicas left (the holders,
    or the whole best tier). In tier 2 (no free seat): power of two choices among the best tier.
    """
    if not keyed:
        return []
    if matches is not None:
        match_of = {id(kr[1]): m for kr, m in zip(keyed, matches)}
    order = sorted(keyed, key=lambda kr: (kr[0], random.random()))
    best_tier, best_waiting = order[0][0][0], order[0][0][1]
    best = [kr for kr in order if kr[0][0] == best_tier and kr[0][1] == best_waiting]
    if (matches is not None or holds is not None) and best_tier <= 1:
        least = min(kr[0][3] for kr in best)
        eligible = [kr for kr in best if kr[0][3] - least <= max_imbalance]
        if holds is not None:
            hold_of = {id(kr[1]): int(h) for kr, h in zip(keyed, holds)}
            surest = max(hold_of[id(kr[1])] for kr in eligible)
            free = {id(kr[1]) for kr, f in zip(keyed, slot_free or ()) if f}
            holding = ([kr for kr in eligible if hold_of[id(kr[1])] == surest] if surest > 0
                       else [kr for kr in eligible if id(kr[1]) in free])
            if holding:
                best = eligible = holding
        if matches is not None:
            longest = max(match_of[id(kr[1])] for kr in eligible)
            if longest >= max(1, min_match):
                best = [kr for kr in eligible if match_of[id(kr[1])] == longest]
    pair = random.sample(best, 2) if len(best) >= 2 else best
    pair.sort(key=lambda kr: (kr[0][3], kr[0][2], random.random()))  # fewer requests, then more free blocks
    ranks = [[kr[1]] for kr in pair]
    chosen = {id(kr[1]) for kr in pair}
    for tier in (0, 1, 2):
        group = [kr[1] for kr in order if kr[0][0] == tier and id(kr[1]) not in chosen]
        if group:
            ranks.append(group)
    return ranks
