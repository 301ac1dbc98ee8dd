"""BlockManager: allocation, free order, ref counts, usage and the integrity check.

Pure Python: this module must not import torch (the block manager is plain Python by design).
"""

from __future__ import annotations

import pytest

from replica.core.block_manager import BlockManager


def test_fresh_pool():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.num_free_blocks == 8
    assert bm.num_used_blocks == 0
    assert bm.usage == 0.0
    assert bm.owners() == []
    assert bm.block_table("nobody") == []
    bm.check_integrity()


@pytest.mark.parametrize("num_blocks, block_size", [(0, 16), (-1, 16), (4, 0), (4, -2)])
def test_bad_sizes_raise(num_blocks, block_size):
    with pytest.raises(ValueError, match="num_blocks" if num_blocks < 1 else "block_size"):
        BlockManager(num_blocks=num_blocks, block_size=block_size)


@pytest.mark.parametrize(
    "num_tokens, expected",
    [(0, 0), (1, 1), (3, 1), (4, 1), (5, 2), (8, 2), (9, 3), (16, 4), (17, 5)],
)
def test_blocks_needed_is_ceiling(num_tokens, expected):
    assert BlockManager(num_blocks=8, block_size=4).blocks_needed(num_tokens) == expected


def test_allocate_grows_table_in_order_and_returns_only_new_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate("a", 5) == [0, 1]  # 5 tokens → 2 blocks, taken from the front of the queue
    assert bm.block_table("a") == [0, 1]
    assert bm.allocate("a", 8) == []  # still 2 blocks
    assert bm.allocate("a", 6) == []  # never shrinks
    assert bm.allocate("b", 1) == [2]
    assert bm.allocate("a", 9) == [3]  # grows by one block, after b's
    assert bm.block_table("a") == [0, 1, 3]
    assert bm.block_table("b") == [2]
    assert bm.num_used_blocks == 4 and bm.num_free_blocks == 4
    assert bm.usage == 0.5
    assert sorted(bm.owners()) == ["a", "b"]
    assert bm._ref_counts == [1, 1, 1, 1, 0, 0, 0, 0]
    bm.check_integrity()


def test_block_table_is_a_copy():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", 3)
    table = bm.block_table("a")
    table.append(99)
    assert bm.block_table("a") == [0, 1]
    bm.check_integrity()


def test_num_new_blocks_for_and_can_allocate():
    bm = BlockManager(num_blocks=4, block_size=4)
    assert bm.num_new_blocks_for("a", 16) == 4
    assert bm.can_allocate("a", 16)
    assert not bm.can_allocate("a", 17)  # 5 blocks > 4 in the pool
    bm.allocate("a", 8)
    assert bm.num_new_blocks_for("a", 8) == 0
    assert bm.num_new_blocks_for("a", 9) == 1
    assert bm.num_new_blocks_for("a", 4) == 0
    assert bm.can_allocate("a", 16)  # 2 more needed, 2 free
    assert not bm.can_allocate("a", 17)
    assert bm.can_allocate("b", 8)
    assert not bm.can_allocate("b", 9)


def test_out_of_blocks_raises_and_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    bm.allocate("a", 8)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate("b", 5)  # needs 2, 1 free
    assert bm.block_table("b") == []
    assert "b" not in bm.owners()
    assert bm.num_free_blocks == 1
    with pytest.raises(RuntimeError):
        bm.allocate("a", 13)  # a needs 2 more, 1 free
    assert bm.block_table("a") == [0, 1]
    bm.check_integrity()
    assert bm.allocate("b", 4) == [2]
    assert bm.num_free_blocks == 0 and bm.usage == 1.0
    bm.check_integrity()


def test_free_returns_count_and_reverses_into_the_back_of_the_queue():
    bm = BlockManager(num_blocks=6, block_size=2)
    bm.allocate("a", 6)  # [0, 1, 2]
    bm.allocate("b", 2)  # [3]
    assert bm.free("a") == 3
    assert bm.block_table("a") == []
    assert bm.owners() == ["b"]
    assert bm._ref_counts == [0, 0, 0, 1, 0, 0]
    # Free queue is now [4, 5, 2, 1, 0]: untouched blocks first, then a's blocks tail first.
    assert list(bm._free) == [4, 5, 2, 1, 0]
    assert bm.allocate("c", 10) == [4, 5, 2, 1, 0]
    assert bm.num_free_blocks == 0
    bm.check_integrity()


def test_free_unknown_or_twice_is_a_no_op():
    bm = BlockManager(num_blocks=4, block_size=4)
    assert bm.free("ghost") == 0
    bm.allocate("a", 4)
    assert bm.free("a") == 1
    assert bm.free("a") == 0
    assert bm.num_free_blocks == 4
    bm.check_integrity()


def test_allocate_zero_tokens_gives_no_blocks():
    bm = BlockManager(num_blocks=2, block_size=4)
    assert bm.allocate("a", 0) == []
    assert bm.num_free_blocks == 2
    assert bm.free("a") == 0
    bm.check_integrity()


def test_many_owners_round_trip():
    bm = BlockManager(num_blocks=10, block_size=3)
    sizes = {"a": 7, "b": 1, "c": 9, "d": 3}  # 3 + 1 + 3 + 1 = 8 blocks
    for owner, n in sizes.items():
        bm.allocate(owner, n)
    assert bm.num_used_blocks == 8
    assert bm.usage == pytest.approx(0.8)
    owned = [b for owner in sizes for b in bm.block_table(owner)]
    assert sorted(owned) == list(range(8))
    bm.check_integrity()
    for owner in ["c", "a", "d", "b"]:
        bm.free(owner)
        bm.check_integrity()
    assert bm.num_free_blocks == 10 and bm.usage == 0.0
    assert sorted(bm._free) == list(range(10))


# ---- check_integrity must catch corrupted accounting ------------------------------------------


def _two_owners() -> BlockManager:
    bm = BlockManager(num_blocks=6, block_size=4)
    bm.allocate("a", 8)  # [0, 1]
    bm.allocate("b", 4)  # [2]
    bm.check_integrity()
    return bm


def test_integrity_catches_leaked_block():
    bm = _two_owners()
    # Drop b's table without returning its block: block 2 is neither free nor owned.
    del bm._tables["b"]
    bm._ref_counts[2] = 0
    with pytest.raises(AssertionError, match="block 2 is neither free nor owned"):
        bm.check_integrity()


def test_integrity_catches_leak_with_stale_ref_count():
    bm = _two_owners()
    del bm._tables["b"]  # ref count still 1, no owner
    with pytest.raises(AssertionError, match="block 2: ref count 1 but 0 owners"):
        bm.check_integrity()


def test_integrity_catches_double_owned_block():
    bm = _two_owners()
    bm._tables["b"].append(0)  # block 0 now listed by a and b
    bm._ref_counts[0] = 2
    with pytest.raises(AssertionError, match="block 0 is owned 2 times"):
        bm.check_integrity()


def test_integrity_catches_double_owned_block_with_ref_count_one():
    bm = _two_owners()
    bm._tables["b"].append(1)
    with pytest.raises(AssertionError, match="block 1: ref count 1 but 2 owners"):
        bm.check_integrity()


def test_integrity_catches_block_listed_twice_by_one_owner():
    bm = _two_owners()
    bm._tables["a"].append(0)
    with pytest.raises(AssertionError, match="'a' lists a block twice"):
        bm.check_integrity()


def test_integrity_catches_block_free_and_owned():
    bm = _two_owners()
    bm._free.append(1)  # block 1 belongs to a, and is free too
    with pytest.raises(AssertionError, match="block 1 is free and owned"):
        bm.check_integrity()


def test_integrity_catches_block_twice_in_free_queue():
    bm = _two_owners()
    bm._free.append(bm._free[0])
    with pytest.raises(AssertionError, match="twice in the free queue"):
        bm.check_integrity()


def test_integrity_catches_double_free():
    bm = _two_owners()
    # A buggy second free of b's block: it is in the queue twice.
    bm.free("b")
    bm._free.append(2)
    with pytest.raises(AssertionError):
        bm.check_integrity()


# ---- prefix caching ---------------------------------------------------------------------------
H = [bytes([i]) * 32 for i in range(8)]  # stand-ins for chained block hashes


def cached_pool(num_blocks: int = 6) -> BlockManager:
    bm = BlockManager(num_blocks=num_blocks, block_size=4, enable_caching=True)
    bm.allocate("a", 12)  # blocks 0, 1, 2
    bm.cache_blocks("a", H[:3], 0)
    return bm


def test_cached_prefix_finds_the_longest_registered_run():
    bm = cached_pool()
    assert bm.cached_prefix(H[:3], 8) == [0, 1, 2]
    assert bm.cached_prefix(H[:3], 2) == [0, 1]  # capped (the last token is always computed)
    assert bm.cached_prefix([H[0], H[5], H[2]], 8) == [0]  # a chain stops at its first miss
    assert bm.cached_prefix([H[5]], 8) == []
    assert BlockManager(4, 4).cached_prefix(H[:1], 8) == []  # caching off: never a hit
    bm.check_integrity()


def test_shared_blocks_are_ref_counted_and_stay_cached_when_freed():
    bm = cached_pool()
    hit = bm.cached_prefix(H[:2], 8)
    assert bm.allocate("b", 10, hit) == [3]  # 2 shared blocks + 1 new one
    assert bm.block_table("b") == [0, 1, 3] and bm.num_free_blocks == 2
    bm.check_integrity()
    assert bm.free("a") == 1  # block 2 only: 0 and 1 are still b's
    assert bm.free("b") == 3
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 3  # free, and still cached
    assert bm.cached_prefix(H[:3], 8) == [0, 1, 2]
    bm.check_integrity()


def test_a_hit_on_free_cached_blocks_takes_them_out_of_the_free_pool():
    bm = cached_pool(num_blocks=4)
    bm.free("a")
    hit = bm.cached_prefix(H[:3], 8)
    assert bm.can_allocate("b", 16, hit)  # 3 cached + 1 new = the whole pool
    assert not bm.can_allocate("b", 20, hit)
    bm.allocate("b", 16, hit)
    assert bm.num_free_blocks == 0 and bm.block_table("b") == [0, 1, 2, 3]
    bm.check_integrity()


def test_never_cached_blocks_go_first_then_the_least_recently_freed_cached_one_is_evicted():
    bm = cached_pool(num_blocks=5)
    bm.allocate("b", 4)
    bm.cache_blocks("b", [H[7]], 0)  # block 3
    bm.free("b")  # freed first: least recently used
    bm.free("a")  # frees 2, 1, 0 (the tail of a sequence first)
    assert bm.allocate("c", 4) == [4]  # the never-cached block
    assert bm.num_evictions == 0
    assert bm.allocate("d", 8) == [3, 2]  # then LRU: b's block, then a's tail
    assert bm.num_evictions == 2 and bm.cached_prefix([H[7]], 1) == [] and bm.cached_prefix(H[:3], 8) == [0, 1]
    bm.check_integrity()


def test_a_hash_cached_twice_keeps_its_first_block():
    bm = cached_pool()
    bm.allocate("b", 4)  # block 3, computed again by a request that did not look up
    bm.cache_blocks("b", [H[0]], 0)
    assert bm.cached_prefix([H[0]], 1) == [0] and bm.num_cached_blocks == 3
    bm.free("b")
    assert bm.num_free_blocks == 3 and 3 in bm._free  # block 3 went back uncached
    bm.check_integrity()


def test_uncache_and_reset():
    bm = cached_pool()
    assert bm.uncache(bm.block_table("a")) == 3 and bm.cached_prefix(H[:1], 1) == []
    bm.free("a")
    bm.check_integrity()
    bm.allocate("b", 8)
    bm.cache_blocks("b", H[:2], 0)
    bm.free("b")
    assert bm.reset_prefix_cache() == 2 and bm.num_cached_blocks == 0 and bm.num_free_blocks == 6
    bm.check_integrity()


def test_uncaching_a_freed_block_makes_it_a_plain_free_block():
    """A step that filled a request's blocks fails after the request ended (its blocks are free
    and cached): uncaching them leaves a consistent pool, and they are reused before cached ones."""
    bm = cached_pool()
    bm.free("a")  # blocks 0, 1, 2: free and cached
    assert bm.uncache([1, 2]) == 2
    bm.check_integrity()
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 1 and bm.cached_prefix(H[:3], 3) == [0]
    bm.allocate("b", 20)  # 5 blocks: the 3 never used, then 1 and 2; block 0 stays cached
    assert sorted(bm.block_table("b")) == [1, 2, 3, 4, 5] and bm.cached_prefix(H[:1], 1) == [0]
    bm.check_integrity()


def test_integrity_catches_cache_inconsistencies():
    bm = cached_pool()
    bm._hash_to_block[H[0]] = 5  # the table points at another block
    with pytest.raises(AssertionError, match="hash maps to block 5"):
        bm.check_integrity()
    bm = cached_pool()
    bm.free("a")
    bm._free.append(bm._cached_free.popitem()[0])  # a cached free block in the uncached list
    with pytest.raises(AssertionError, match="both free lists|wrong free list"):
        bm.check_integrity()
    bm = cached_pool()
    bm._tables["b"] = [3]
    bm._ref_counts[3] = 1
    bm._tables["c"] = [3]
    bm._ref_counts[3] = 2
    bm._free.remove(3)
    with pytest.raises(AssertionError, match="no cached block"):  # sharing an uncached block
        bm.check_integrity()
