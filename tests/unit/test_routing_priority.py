"""Priority-aware routing (the ``priority`` scheduling policy): a request's load on a replica
counts only the requests there it would not overtake (``router/routing/ranking.py``
``priority_load``), so a high-priority request goes where it starts soonest. Without Ray: keys,
and the router with fake replicas (test_policy.py's)."""

from __future__ import annotations

import random
from types import SimpleNamespace

from replica.protocol.envelope import RequestEnvelope, RoutingHints
from replica.protocol.sampling_params import SamplingParams
from router.routing.policy import replica_key
from router.routing.ranking import priority_load
from tests.unit.test_policy import BLOCK_SIZE, FakeReplica, make_router, route, stats


def test_priority_load_counts_only_the_requests_a_request_would_not_overtake():
    # 8 seats, all taken by priority-5 requests, 2 more waiting at priority 0.
    busy = {**stats(running=8, waiting=2), "priority_counts": [[0, 2], [5, 8]]}
    assert priority_load(busy, 0, 10) == 2  # only the two of equal priority run before it
    assert priority_load(busy, 5, 10) == 10
    assert priority_load(busy, -1, 10) == 0
    assert priority_load(busy, 0, 13) == 5  # 3 sent since the report: priority unknown, counted as ahead
    assert priority_load(stats(running=8, waiting=2), 0, 10) == 10  # fcfs: no counts, every request
    assert replica_key(busy, 10, priority=0)[0] == 0  # a free seat for it: it would preempt the others
    assert replica_key(busy, 10, priority=5)[:2] == (2, 2)
    assert replica_key(busy, 10) == replica_key(busy, 10, priority=None)


def test_a_high_priority_request_goes_where_it_starts_soonest():
    """Replica a: 8 seats of priority-9 requests (it would preempt them); b: 6 seats of priority-0
    requests and 2 waiting. Load alone says b (8 < 10); for a priority-0 request a is free."""
    random.seed(6)
    replicas = [
        FakeReplica("a", num_running=8, num_waiting=2, priority_counts=[[9, 10]]),
        FakeReplica("b", num_running=6, num_waiting=2, priority_counts=[[0, 8]]),
    ]
    router = make_router(replicas)

    def request(rid: str, priority: int) -> SimpleNamespace:
        envelope = RequestEnvelope(f"rid-{rid}", [1], SamplingParams(), RoutingHints.of([1], BLOCK_SIZE), priority=priority)
        return SimpleNamespace(args=[], kwargs={"request": envelope},
                               metadata=SimpleNamespace(internal_request_id=rid, call_method="generate"))

    for i in range(20):
        assert route(router, replicas, request(f"high-{i}", 0)).name == "a"
        assert route(router, replicas, request(f"low-{i}", 9)).name == "b"
