"""Adapter-aware routing (router/routing/policy.py with router/routing/lora_affinity.py), without
Ray: a LoRA request prefers a free-seat replica that holds its adapter, within the imbalance bound;
prefix matches are per adapter; the switch turns it off."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from types import SimpleNamespace

from replica.protocol.lora_request import LoRARequest
from replica.protocol.prefix_hash import ROOT
from replica.protocol.envelope import RoutingHints
from router.routing.lora_affinity import LoRAAffinity
from router.routing.policy import rank_replicas, replica_key
from router.routing.prefix_affinity import PrefixAffinity
from tests.unit.test_policy import FakeReplica, finish, make_router, stats
from tests.unit.test_policy import pending as base_pending


def lora(name: str) -> LoRARequest:
    return LoRARequest(name, 0, f"/adapters/{name}")


def pending(request_id: str, prompt: list[int] | None, adapter: str | None) -> SimpleNamespace:
    return base_pending(request_id, prompt, lora(adapter) if adapter is not None else None)


def route(router, replicas, request, complete: bool = True) -> FakeReplica:
    [chosen] = asyncio.run(router.choose_replicas(replicas, request))[0]
    router.on_send_request(chosen.replica_id)
    router.on_request_routed(request, chosen.replica_id, None)
    if complete:
        finish(router, chosen, request)
    return chosen


def test_routing_hints_name_the_adapter_and_root_its_hashes():
    assert RoutingHints.of([1] * 8, 4, lora("sql")).adapter == "sql"
    assert RoutingHints.of([1] * 8, 4).adapter is None
    assert RoutingHints.of([1] * 8, 4).prefix_hashes == tuple(PrefixAffinity.hashes([1] * 8, 4, ROOT))
    assert RoutingHints.of([1] * 8, 4, lora("sql")).prefix_hashes == tuple(PrefixAffinity.hashes([1] * 8, 4, lora("sql").hash_root))
    prompt = list(range(40))
    base = PrefixAffinity.hashes(prompt, 4)
    under = PrefixAffinity.hashes(prompt, 4, lora("sql").hash_root)
    assert len(base) == len(under) == 10 and not set(base) & set(under)  # the same tokens, other blocks


def test_a_holder_wins_among_free_seat_replicas_within_the_bound():
    keyed = [(replica_key(stats(), 3), "holder"), (replica_key(stats(), 0), "idle")]
    for _ in range(100):
        assert rank_replicas(keyed, holds=[True, False], max_imbalance=4)[0] == ["holder"]
    keyed = [(replica_key(stats(slots=32), 9), "holder"), (replica_key(stats(slots=32), 4), "idle")]
    for _ in range(100):  # 5 requests ahead, bound 4: the load decides
        assert rank_replicas(keyed, holds=[True, False], max_imbalance=4)[0] == ["idle"]
    keyed = [(replica_key(stats(), 8), "full holder"), (replica_key(stats(), 7), "one seat left")]
    for _ in range(100):  # never a replica without a free seat while another has one
        assert rank_replicas(keyed, holds=[True, False])[0] == ["one seat left"]
    keyed = [(replica_key(stats(), 0), r) for r in "ab"]
    firsts = Counter(rank_replicas(keyed, holds=[False, False])[0][0] for _ in range(400))
    assert 120 < firsts["a"] < 280, firsts  # nobody holds it: power of two choices


def test_the_prefix_match_decides_among_the_holders_only():
    keyed = [(replica_key(stats(), 1), "holder, no match"), (replica_key(stats(), 0), "match, no adapter"),
             (replica_key(stats(), 2), "holder, match")]
    for _ in range(100):
        assert rank_replicas(keyed, matches=[0, 9, 5], holds=[True, False, True])[0] == ["holder, match"]
        assert rank_replicas(keyed, matches=[0, 9, 0], holds=[True, False, True])[0] == ["holder, no match"]


def test_each_adapter_stays_on_the_replica_it_went_to():
    """4 adapters over 2 replicas, one request at a time: after its first request (placed by
    load), every adapter's requests go where it went (the router's own record, no reports)."""
    random.seed(7)
    replicas = [FakeReplica("a"), FakeReplica("b")]
    router = make_router(replicas, max_loras=4)
    homes: dict[str, set[str]] = {name: set() for name in "wxyz"}
    for i in range(80):
        name = "wxyz"[i % 4]
        homes[name].add(route(router, replicas, pending(f"r{i}", [i] * 3, name)).name)
    assert all(len(h) == 1 for h in homes.values()), homes


def test_a_hot_adapter_spreads_once_its_replica_is_loaded_and_then_both_hold_it():
    random.seed(2)
    replicas = [FakeReplica("a"), FakeReplica("b")]
    router = make_router(replicas)  # 8 seats: bound max(4, 2) = 4 requests
    chosen = [route(router, replicas, pending(f"r{i}", None, "hot"), complete=False).name for i in range(12)]
    counts = Counter(chosen)
    assert chosen[:5] == [chosen[0]] * 5  # follows its adapter while within the bound
    assert min(counts.values()) >= 4, counts  # then the other replica takes its share
    assert all("hot" in router.loras.recorded(r.replica_id) for r in replicas)


def test_a_replicas_report_counts_as_holding():
    replicas = [FakeReplica("a"), FakeReplica("b", lora_loaded=["sql"])]
    router = make_router(replicas)
    for i in range(50):
        assert route(router, replicas, pending(f"r{i}", None, "sql")).name == "b"


def test_adapter_aware_routing_off_ignores_adapters():
    random.seed(4)
    replicas = [FakeReplica("a"), FakeReplica("b", lora_loaded=["sql"])]
    router = make_router(replicas, lora_aware=False)
    chosen = Counter(route(router, replicas, pending(f"r{i}", None, "sql")).name for i in range(200))
    assert 60 < chosen["a"] < 140, chosen


def test_base_requests_ignore_adapters_and_a_dead_replica_is_forgotten():
    random.seed(5)
    replicas = [FakeReplica("a", lora_loaded=["sql"]), FakeReplica("b")]
    router = make_router(replicas)
    chosen = Counter(route(router, replicas, pending(f"r{i}", None, None)).name for i in range(200))
    assert 60 < chosen["a"] < 140, chosen
    held = route(router, replicas, pending("x", None, "chat"))
    router.on_replica_actor_died(held.replica_id)
    assert router.loras.recorded(held.replica_id) == []


def test_the_record_is_an_lru_of_max_loras_names():
    record = LoRAAffinity(max_loras=2)
    for name in ("a", "b", "a", "c"):
        record.record("r1", name)
    assert record.recorded("r1") == ["a", "c"]  # b was least recently sent
    assert [record.holds("a", r, reported) for r, reported in [("r1", None), ("r2", ["a"]), ("r3", [])]] == [1, 1, 0]
    record.hold("req", "z")
    assert record.confirm("req", "r3") and not record.confirm("req", "r3")
    assert record.recorded("r3") == ["z"] and record.holds("z", "r3", None) == 2  # in flight: surely
    record.finish("req")
    assert record.holds("z", "r3", None) == 1


def test_an_adapter_nobody_holds_goes_where_a_slot_is_free_of_requests():
    """One slot per replica: 'a' runs on one replica; a new adapter goes to the other (no wait
    for a slot), even when that one is busier, within the bound; once 'a' is done, by load."""
    random.seed(6)
    replicas = [FakeReplica("a"), FakeReplica("b")]
    router = make_router(replicas, max_loras=1)
    first = route(router, replicas, pending("r0", None, "sql"), complete=False)
    other = next(r for r in replicas if r is not first)
    for i in range(3):  # base requests load the other replica (no adapter: slots not used)
        router.on_send_request(other.replica_id)
    for i in range(20):
        assert route(router, replicas, pending(f"n{i}", None, "chat")).name == other.name
    assert router.loras.active(first.replica_id) == 1 and router.loras.active(other.replica_id) == 0
    finish(router, first, pending("r0", None, "sql"))
    assert router.loras.active(first.replica_id) == 0
    keyed = [(replica_key(stats(), 0), "a"), (replica_key(stats(), 1), "b")]
    for _ in range(50):
        assert rank_replicas(keyed, holds=[False, False], slot_free=[False, True])[0] == ["b"]
        assert rank_replicas(keyed, holds=[True, False], slot_free=[False, True])[0] == ["a"]  # a holder first


def test_the_replica_running_the_adapter_wins_over_one_that_may_hold_it():
    """'b' reports the adapter (perhaps evicted since), 'a' runs requests of it: 'a', so a hot
    adapter stays where it runs instead of spreading on stale reports."""
    replicas = [FakeReplica("a"), FakeReplica("b", lora_loaded=["sql"])]
    router = make_router(replicas)
    router.loras.hold("first", "sql")
    router.loras.confirm("first", replicas[0].replica_id)  # in flight on 'a'
    for i in range(30):
        assert route(router, replicas, pending(f"r{i}", None, "sql")).name == "a"
    keyed = [(replica_key(stats(), 0), "a"), (replica_key(stats(), 0), "b")]
    for _ in range(50):
        assert rank_replicas(keyed, holds=[1, 2])[0] == ["b"]


def test_a_burst_routed_before_any_confirmation_follows_the_first_placement():
    """Serve confirms a request's replica a round trip after choosing it: the requests of a burst
    of one adapter see where the first went (its placement counts at once), within the bound."""
    random.seed(8)
    replicas = [FakeReplica("a"), FakeReplica("b")]
    router = make_router(replicas)
    burst = [pending(f"r{i}", None, "hot") for i in range(4)]
    chosen = []
    for request in burst:
        [replica] = asyncio.run(router.choose_replicas(replicas, request))[0]
        router.on_send_request(replica.replica_id)
        chosen.append(replica.name)
    assert len(set(chosen)) == 1, chosen
    for request, name in zip(burst, chosen):  # Serve's confirmations, then the ends
        router.on_request_routed(request, next(r for r in replicas if r.name == name).replica_id, None)
    assert router.loras.active(replicas[0].replica_id) + router.loras.active(replicas[1].replica_id) == 1
    for request, name in zip(burst, chosen):
        finish(router, next(r for r in replicas if r.name == name), request)
    assert router.loras.active(replicas[0].replica_id) == router.loras.active(replicas[1].replica_id) == 0


def test_a_placement_serve_never_confirms_lapses():
    record = LoRAAffinity(max_loras=2)
    record.hold("req", "sql")
    record.place("req", "r1", now=10.0)
    assert record.active("r1") == 1 and record.holds("sql", "r1", None) == 2
    record.expire(now=10.5)
    assert record.active("r1") == 1
    record.expire(now=11.5)
    assert record.active("r1") == 0 and record.holds("sql", "r1", None) == 0
    assert record.confirm("req", "r2") and record.active("r2") == 1  # a late confirmation still counts
