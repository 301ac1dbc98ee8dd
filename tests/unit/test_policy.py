"""The request router's ranking (router/policy.py), without Ray: keys and ranked groups."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from router.policy import rank_replicas, replica_key


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
