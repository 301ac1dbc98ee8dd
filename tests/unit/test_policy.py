"""The request router's ranking (router/routing/policy.py), without Ray: keys and ranked groups."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from router.routing.policy import rank_replicas, replica_key


def stats(slots=8, running=0, waiting=0, free=100, total=100):
    return {"num_slots": slots, "num_running": running, "num_waiting": waiting, "num_free_blocks": free, "num_total_blocks": total}


def test_key_tiers():
    assert replica_key(stats(), 3)[0] == 0  # free seat, blocks free
    assert replica_key(stats(free=2), 3)[0] == 1  # free seat, KV nearly full
    assert replica_key(stats(), 8)[:2] == (2, 0)  # every seat taken
    assert replica_key(stats(), 11)[:2] == (2, 3)  # and 3 waiting
    # the live count wins over the (older) reported one; reported is the fallback
    assert replica_key(stats(running=8), 2)[0] == 0
    assert replica_key(stats(running=8), None)[0] == 2
    assert replica_key({}, None) == (0, 0, 0, 0)  # no stats yet


def test_full_replica_never_first_while_another_has_a_seat():
    keyed = [(replica_key(stats(), 8), "full"), (replica_key(stats(), 7), "one seat left")]
    for _ in range(200):
        assert rank_replicas(keyed)[0] == ["one seat left"]


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 100)), min_size=1, max_size=8))
def test_first_choice_has_a_free_seat_if_any_replica_has_one(loads):
    keyed = [(replica_key(stats(free=free), load), i) for i, (load, free) in enumerate(loads)]
    [first] = rank_replicas(keyed)[0]
    ranked = [r for group in rank_replicas(keyed) for r in group]
    assert sorted(ranked) == list(range(len(loads)))  # every replica appears once
    if any(load < 8 for load, _ in loads):
        assert loads[first][0] < 8
    else:  # all full: the fewest waiting
        assert loads[first][0] == min(load for load, _ in loads)


def test_low_kv_replica_ranks_below_one_with_room():
    keyed = [(replica_key(stats(free=1), 0), "low kv"), (replica_key(stats(free=90), 5), "room")]
    for _ in range(100):
        assert rank_replicas(keyed)[0] == ["room"]


def test_power_of_two_among_equals_spreads_a_burst():
    """Simulate a burst: each routed request raises that replica's live load by one."""
    random.seed(0)
    loads = Counter({r: 0 for r in "abcd"})
    for _ in range(64):
        keyed = [(replica_key(stats(slots=32), loads[r]), r) for r in "abcd"]
        [chosen] = rank_replicas(keyed)[0]
        loads[chosen] += 1
    assert max(loads.values()) - min(loads.values()) <= 2, loads


def test_ties_are_broken_at_random():
    keyed = [(replica_key(stats(), 0), r) for r in "ab"]
    firsts = Counter(rank_replicas(keyed)[0][0] for _ in range(400))
    assert 120 < firsts["a"] < 280, firsts


def test_an_unhealthy_replica_ranks_after_a_full_one():
    dead = {**stats(), "healthy": False}
    keyed = [(replica_key(dead, 0), "dead"), (replica_key(stats(), 30), "full, 22 waiting")]
    assert replica_key(dead, 0)[0] == 3 and replica_key({**stats(), "healthy": True}, 0)[0] == 0
    for _ in range(50):
        assert rank_replicas(keyed)[0] == ["full, 22 waiting"]
    assert rank_replicas([(replica_key(dead, 0), "dead")]) == [["dead"]]  # still chosen if it is the only one


# ---- cache-aware routing (router/routing/prefix_affinity.py, rank_replicas with matches) ----------------

import asyncio  # noqa: E402
from types import SimpleNamespace  # noqa: E402

from router.routing.policy import CarpoolRequestRouter  # noqa: E402
from replica.protocol.envelope import RequestEnvelope, RoutingHints  # noqa: E402
from replica.protocol.lora_request import LoRARequest  # noqa: E402
from replica.protocol.sampling_params import SamplingParams  # noqa: E402
from router.routing.prefix_affinity import PrefixAffinity  # noqa: E402


def test_longest_match_wins_among_free_seat_replicas():
    keyed = [(replica_key(stats(), 2), "short"), (replica_key(stats(), 3), "long"), (replica_key(stats(), 0), "none")]
    for _ in range(200):
        ranks = rank_replicas(keyed, matches=[2, 5, 0])
        assert ranks[0] == ["long"]
        assert sorted(r for g in ranks for r in g) == ["long", "none", "short"]  # the rest follow


def test_a_match_never_sends_to_a_replica_without_a_free_seat():
    keyed = [(replica_key(stats(), 8), "full, cached"), (replica_key(stats(), 7), "one seat left")]
    for _ in range(200):
        assert rank_replicas(keyed, matches=[40, 0])[0] == ["one seat left"]
    # nor to a replica low on KV blocks while another has room (tier 1 after tier 0)
    keyed = [(replica_key(stats(free=1), 0), "low kv, cached"), (replica_key(stats(), 0), "room")]
    for _ in range(200):
        assert rank_replicas(keyed, matches=[40, 0])[0] == ["room"]
    # all full: fewest waiting, whatever the match
    keyed = [(replica_key(stats(), 12), "full, cached"), (replica_key(stats(), 9), "full, fewer waiting")]
    for _ in range(50):
        assert rank_replicas(keyed, matches=[40, 0])[0] == ["full, fewer waiting"]


def test_match_among_tier_1_when_no_replica_is_in_tier_0():
    keyed = [(replica_key(stats(free=2), 0), "low kv"), (replica_key(stats(free=3), 1), "low kv, cached")]
    for _ in range(100):
        assert rank_replicas(keyed, matches=[0, 4])[0] == ["low kv, cached"]


def test_imbalance_guard():
    # the best match carries threshold + 1 more requests than the least loaded: load decides
    keyed = [(replica_key(stats(slots=32), 9), "hot"), (replica_key(stats(slots=32), 4), "idle")]
    for _ in range(100):
        assert rank_replicas(keyed, matches=[10, 0], max_imbalance=4)[0] == ["idle"]
    # within the bound: the match decides
    keyed = [(replica_key(stats(slots=32), 8), "hot"), (replica_key(stats(slots=32), 4), "idle")]
    for _ in range(100):
        assert rank_replicas(keyed, matches=[10, 0], max_imbalance=4)[0] == ["hot"]
    # an excluded replica's match does not hide a smaller match within the bound
    keyed = [
        (replica_key(stats(slots=32), 20), "hot"), (replica_key(stats(slots=32), 3), "warm"),
        (replica_key(stats(slots=32), 2), "idle"),
    ]
    for _ in range(100):
        assert rank_replicas(keyed, matches=[10, 3, 0], max_imbalance=4)[0] == ["warm"]


def test_a_hot_prefix_spreads_once_its_replica_is_loaded():
    """Every request has the same prefix, cached on 'a' only: 'a' takes requests until it is
    max_imbalance ahead, then the load decides (bounded imbalance, SGLang's guard)."""
    random.seed(1)
    loads = Counter({"a": 0, "b": 0})
    for _ in range(40):
        keyed = [(replica_key(stats(slots=32), loads[r]), r) for r in "ab"]
        [chosen] = rank_replicas(keyed, matches=[6, 0], max_imbalance=4)[0]
        loads[chosen] += 1
    assert loads["a"] - loads["b"] in (4, 5), loads


def test_ties_and_zero_matches_fall_back_to_power_of_two():
    # zero matches everywhere: same as load alone (ties at random)
    keyed = [(replica_key(stats(), 0), r) for r in "ab"]
    firsts = Counter(rank_replicas(keyed, matches=[0, 0])[0][0] for _ in range(400))
    assert 120 < firsts["a"] < 280, firsts
    # a tie on the longest match: power of two choices among the tied; the unmatched idle one is out
    keyed = [(replica_key(stats(), 3), "a"), (replica_key(stats(), 1), "b"), (replica_key(stats(), 0), "c")]
    for _ in range(100):
        ranks = rank_replicas(keyed, matches=[4, 4, 0])
        assert ranks[0] == ["b"] and ranks[1] == ["a"], ranks


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 100), st.integers(0, 20)), min_size=1, max_size=8))
def test_with_matches_the_first_choice_still_has_a_free_seat_if_any_replica_has_one(rows):
    keyed = [(replica_key(stats(free=free), load), i) for i, (load, free, _) in enumerate(rows)]
    ranks = rank_replicas(keyed, matches=[m for _, _, m in rows], max_imbalance=4)
    [first] = ranks[0]
    assert sorted(r for g in ranks for r in g) == list(range(len(rows)))
    if any(load < 8 for load, _, _ in rows):
        assert rows[first][0] < 8
        free_seat = [i for i, (load, _, _) in enumerate(rows) if load < 8]
        tier = replica_key(stats(free=rows[first][1]), rows[first][0])[0]
        same_tier = [i for i in free_seat if replica_key(stats(free=rows[i][1]), rows[i][0])[0] == tier]
        least = min(rows[i][0] for i in same_tier)
        if rows[first][0] - least > 4:
            # Chosen by load alone (power of two choices in its tier), never by a match: no replica
            # of the tier within the imbalance bound had one.
            assert all(rows[i][2] == 0 for i in same_tier if rows[i][0] - least <= 4), (first, rows)
    else:
        assert rows[first][0] == min(load for load, _, _ in rows)


def hashes_of(n_blocks: int, seed: int = 0) -> list[bytes]:
    prompt = [(seed * 1000 + i) % 50000 for i in range(n_blocks * 16 + 3)]
    return PrefixAffinity.hashes(prompt, 16)


def test_affinity_match_counts_leading_blocks_only():
    aff = PrefixAffinity()
    h = hashes_of(6)
    assert len(h) == 6 and aff.match("r", h) == 0
    aff.record("r", h[:4])
    assert aff.match("r", h) == 4
    prompt = [i % 50000 for i in range(6 * 16 + 3)]
    other_start = PrefixAffinity.hashes([7] * 16 + prompt[16:], 16)
    assert aff.match("r", other_start) == 0  # chained hashes: equal blocks after another first block differ
    assert aff.match("other", h) == 0
    assert PrefixAffinity.hashes([1] * (16 - 1), 16) == []
    assert PrefixAffinity.hashes(None, 16) == []


def test_affinity_lru_is_bounded_by_the_replicas_kv_pool():
    aff = PrefixAffinity(default_capacity=10)
    old, new = hashes_of(6, seed=1), hashes_of(6, seed=2)
    aff.record("r", old)
    aff.record("r", new)
    assert aff.size("r") == 10
    assert aff.match("r", new) == 6  # the latest prompt whole
    assert aff.match("r", old) == 4  # the older one lost its tail blocks first, as the replica's cache does
    aff.set_capacity("r", 5)  # routing stats: num_total_blocks = 5
    assert aff.size("r") == 5 and aff.match("r", new) == 5 and aff.match("r", old) == 0
    aff.set_capacity("r", 0)  # not reported: ignored
    assert aff.capacity("r") == 5
    aff.record("r", old)  # touching a prompt again makes it the most recent
    assert aff.match("r", old) == 5 and aff.match("r", new) == 0


def test_affinity_forgets_dead_and_removed_replicas_and_confirms_once():
    aff = PrefixAffinity()
    h = hashes_of(3)
    aff.record("a", h)
    aff.record("b", h)
    aff.forget("a")
    assert aff.match("a", h) == 0 and aff.match("b", h) == 3
    aff.retain({"c"})
    assert aff.size("b") == 0
    aff.hold("req-1", h)
    assert aff.pending("req-1") == h
    assert aff.confirm("req-1", "c") is True and aff.match("c", h) == 3
    assert aff.confirm("req-1", "b") is False and aff.size("b") == 0  # confirmed once only




# ---- the router itself, with fake replicas (no Ray cluster) -------------------------------------


class FakeReplica:
    def __init__(self, name: str, **routing_stats) -> None:
        from ray.serve._private.common import DeploymentID, ReplicaID

        self.replica_id = ReplicaID(name, DeploymentID(name="LLMReplica", app_name="test"))
        self.routing_stats = {**stats(slots=8, total=64, free=64), "block_size": 4, **routing_stats}
        self.max_ongoing_requests = 1024
        self.name = name


def make_router(replicas, **kwargs) -> CarpoolRequestRouter:
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    router = CarpoolRequestRouter(
        deployment_id=DeploymentID(name="LLMReplica", app_name="test"),
        handle_source=DeploymentHandleSource.UNKNOWN,
        use_replica_queue_len_cache=True,
    )
    router.initialize_state(**kwargs)
    # What update_replicas sets, without its queue-length probes of real replicas.
    router._replicas = {r.replica_id: r for r in replicas}
    router._replicas_list = list(replicas)
    router._replica_id_set = set(router._replicas)
    return router


BLOCK_SIZE = 4  # the fake replicas' block_size


def pending(
    request_id: str, prompt: list[int] | None, adapter: LoRARequest | None = None, continuation: bool = False,
) -> SimpleNamespace:
    """A pending Serve request as the ingress makes it: ``generate(request=<envelope>, ...)``; with
    neither a prompt nor an adapter, a call of another method (``model_info``); an adapter without a
    prompt gets a one-token prompt (no full block: no prefix hashes)."""
    if prompt is None and adapter is None:
        return SimpleNamespace(
            args=[], kwargs={}, metadata=SimpleNamespace(internal_request_id=request_id, call_method="model_info")
        )
    prompt = [1] if prompt is None else prompt
    envelope = RequestEnvelope(
        "rid-" + request_id, prompt, SamplingParams(), RoutingHints.of(prompt, BLOCK_SIZE, adapter, continuation),
        lora_request=adapter,
    )
    return SimpleNamespace(
        args=[], kwargs={"request": envelope, "announce": True, "channel": None},
        metadata=SimpleNamespace(internal_request_id=request_id, call_method="generate"),
    )


def route(router, replicas, request, complete: bool = True) -> FakeReplica:
    """One routing decision as Serve makes it: choose, send to the first, confirm (and, with
    ``complete``, finish it: see :func:`complete`)."""
    [chosen] = asyncio.run(router.choose_replicas(replicas, request))[0]
    router.on_send_request(chosen.replica_id)
    router.on_request_routed(request, chosen.replica_id, None)
    if complete:
        finish(router, chosen, request)
    return chosen


def finish(router, replica, request) -> None:
    """The request ended: Serve's completion callbacks."""
    router.on_request_completed(replica.replica_id, request.metadata.internal_request_id)
    router.decrement_queue_len_cache(replica.replica_id)


def conversation(c: int, turn: int) -> list[int]:
    """Turn ``turn`` of conversation ``c``: a shared system prompt, then the conversation so far."""
    system = list(range(1000, 1024))  # 6 blocks of 4
    return system + [c * 100 + i for i in range(12 * (turn + 1))]


def test_router_keeps_each_conversation_on_one_replica():
    """16 conversations of 4 turns start at once; turns take equal times (the oldest one in flight
    ends first), and a conversation sends its next turn as soon as one ends."""
    random.seed(3)
    replicas = [FakeReplica("a"), FakeReplica("b")]
    router = make_router(replicas)  # 8 seats: imbalance bound max(4, 0.125 x 8) = 4 requests
    homes: dict[int, list[str]] = {c: [] for c in range(16)}
    in_flight = {}
    n = 0

    def send(c: int) -> None:
        nonlocal n
        n += 1
        request = pending(f"req-{n}", conversation(c, len(homes[c])))
        replica = route(router, replicas, request, complete=False)
        homes[c].append(replica.name)
        in_flight[c] = (replica, request)

    for c in range(16):
        send(c)
    while in_flight:
        c = next(iter(in_flight))
        finish(router, *in_flight.pop(c))
        if len(homes[c]) < 4:
            send(c)
    # Turn 0: the shared system prompt draws the first requests to one replica until it is more
    # than 4 requests ahead; then both hold it and tie, and the load decides. Later turns follow
    # their conversation's prefix.
    assert all(len(set(h)) == 1 for h in homes.values()), homes
    per_replica = Counter(h[0] for h in homes.values())
    assert sorted(per_replica.values()) == [8, 8], per_replica


def test_router_seat_only_ignores_matches():
    random.seed(4)
    replicas = [FakeReplica("a"), FakeReplica("b")]
    router = make_router(replicas, prefix_aware=False)
    chosen = Counter(route(router, replicas, pending(f"req-{i}", conversation(0, 3))).name for i in range(200))
    assert 60 < chosen["a"] < 140, chosen
    assert router.affinity.size(replicas[0].replica_id) == 0


def test_router_forgets_a_dead_replica_and_bounds_its_record():
    replicas = [FakeReplica("a", num_total_blocks=10, num_free_blocks=10), FakeReplica("b", num_total_blocks=10, num_free_blocks=10)]
    router = make_router(replicas)
    chosen = route(router, replicas, pending("req-1", conversation(0, 3)))  # 6 + 12 blocks of 4 tokens
    assert router.affinity.size(chosen.replica_id) == 10  # the replica's num_total_blocks
    router.on_replica_actor_died(chosen.replica_id)
    assert router.affinity.size(chosen.replica_id) == 0
    alive = [r for r in replicas if r is not chosen]
    assert route(router, alive, pending("req-2", conversation(0, 3))) is alive[0]


def test_router_without_pending_request_or_prompt():
    replicas = [FakeReplica("a"), FakeReplica("b")]
    router = make_router(replicas)
    assert len(asyncio.run(router.choose_replicas(replicas, None))[0]) == 1
    for req in (pending("x", None), pending("y", []), pending("z", [1, 2])):  # no prompt, empty, under a block
        [first] = asyncio.run(router.choose_replicas(replicas, req))[0]
        router.on_request_routed(req, first.replica_id, None)
    assert all(router.affinity.size(r.replica_id) == 0 for r in replicas)
    assert asyncio.run(router.choose_replicas([], pending("w", [1] * 20))) == []


def test_router_imbalance_bound_from_seats():
    router = make_router([FakeReplica("a", num_slots=32)])
    assert router.max_imbalance([FakeReplica("a", num_slots=64)]) == 8  # 0.125 x 64 seats
    assert router.max_imbalance([FakeReplica("a", num_slots=32)]) == 4  # at least 4 requests
    assert router.max_imbalance([FakeReplica("a", num_slots=8)]) == 4  # at least 4 requests
    assert router.max_imbalance([FakeReplica("a", num_slots=0)]) == 4  # before the first poll
    router = make_router([], prefix_balance_abs_threshold=2, prefix_balance_rel_threshold=0.5)
    assert router.max_imbalance([FakeReplica("a", num_slots=32)]) == 16


def test_router_records_at_completion_without_serves_handshake():
    """A caller without Serve's queue-length handshake never gets on_request_routed: the prompt
    is recorded where it completed; with the handshake, completion only drops what it held."""
    replicas = [FakeReplica("a"), FakeReplica("b")]
    router = make_router(replicas)
    request = pending("req-1", conversation(0, 1))
    [chosen] = asyncio.run(router.choose_replicas(replicas, request))[0]
    router.on_send_request(chosen.replica_id)
    assert router.affinity.size(chosen.replica_id) == 0
    finish(router, chosen, request)
    assert router.affinity.size(chosen.replica_id) == len(conversation(0, 1)) // 4
    other = next(r for r in replicas if r is not chosen)
    route(router, replicas, pending("req-2", conversation(5, 0)))  # handshake seen from now on
    rejected = pending("req-3", conversation(6, 0))
    asyncio.run(router.choose_replicas(replicas, rejected))
    finish(router, other, rejected)  # rejected by Serve: completed without being routed
    assert router.affinity.match(other.replica_id, PrefixAffinity.hashes(conversation(6, 0), 4)) <= 6  # shared system prompt at most
    assert router.affinity.pending("req-3") is None


def test_a_match_under_the_minimum_does_not_count():
    keyed = [(replica_key(stats(), 3), "short match"), (replica_key(stats(), 0), "idle")]
    for _ in range(100):
        assert rank_replicas(keyed, matches=[2, 0], min_match=3)[0] == ["idle"]  # load decides
        assert rank_replicas(keyed, matches=[3, 0], min_match=3)[0] == ["short match"]


def test_new_conversations_sharing_a_short_system_prompt_spread_by_load():
    """SGLang's cache_threshold: a new conversation whose only match is a system prompt under 0.3
    of its blocks goes by load (here: requests end before the next one, so at random); one that
    shares most of its prompt follows the match."""
    random.seed(5)
    replicas = [FakeReplica("a"), FakeReplica("b")]
    router = make_router(replicas)
    system = list(range(1000, 1008))  # 2 blocks of 4
    homes = Counter(
        route(router, replicas, pending(f"short-{c}", system + [c * 100 + i for i in range(40)])).name for c in range(40)
    )
    assert min(homes.values()) >= 12, homes  # 2 of 12 blocks match: by load
    router = make_router(replicas)
    system = list(range(1000, 1040))  # 10 blocks of 4
    homes = Counter(
        route(router, replicas, pending(f"long-{c}", system + [c * 100 + i for i in range(8)])).name for c in range(40)
    )
    assert max(homes.values()) >= 39, homes  # 10 of 12 blocks match: the replica that holds them


def test_a_continuation_follows_any_match_of_its_conversation():
    """A Responses follow-up (``RoutingHints.continuation``) whose earlier turn is 2 of its 12
    blocks (a short first prompt, a long reply) goes where that turn went; the same prompt without
    the hint is under the 0.3 minimum and goes by load (here at random: the first turn has ended)."""
    random.seed(7)
    replicas = [FakeReplica("a"), FakeReplica("b")]
    followed = {True: 0, False: 0}
    for continuation in (True, False):
        for c in range(40):
            router = make_router(replicas)
            first = [c * 1000 + i for i in range(8)]  # 2 blocks
            home = route(router, replicas, pending(f"first-{c}", first))
            follow_up = first + [c * 1000 + 500 + i for i in range(40)]  # 12 blocks, 2 of them matching
            followed[continuation] += route(router, replicas, pending(f"next-{c}", follow_up, continuation=continuation)) is home
    assert followed[True] == 40
    assert 8 <= followed[False] <= 32, followed
