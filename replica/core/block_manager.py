"""KV block accounting: free blocks, block tables, reference counts and the prefix cache.

Plain Python, no torch: the physical tensors live in ``replica.worker.kv_cache``; this module only
decides which block ids a request owns. The scheme is vLLM's PagedAttention block manager
(Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with
PagedAttention", arXiv:2309.06180): a request's K/V for token ``i`` lives in block
``block_ids[i // block_size]`` at offset ``i % block_size``.

**Prefix caching** (vLLM v1's automatic prefix caching): a full block whose K/V is computed is
registered under its chained hash (:mod:`replica.protocol.prefix_hash`). A new request looks up the hashes
of its full blocks (:meth:`BlockManager.cached_prefix`) and takes the blocks found (reference
count + 1) instead of computing them. A block whose last owner leaves keeps its contents and hash
and waits in an LRU list of cached free blocks; it is evicted (its hash dropped) only when a new
block is needed and no never-cached free block is left. So ``num_free_blocks`` counts cached free
blocks too: they are free to hand out, and the pool's accounting stays "every block is free or
owned".
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence


class BlockManager:
    """Hands out KV blocks of ``block_size`` tokens from a pool of ``num_blocks``.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        enable_caching: keep full blocks' K/V for reuse by later requests (prefix caching).
    Raises:
        ValueError: ``num_blocks`` or ``block_size`` below 1.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._free: deque[int] = deque(range(num_blocks))  # free and holding no cached K/V
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # free but cached, LRU first
        self._ref_counts = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._hash_to_block: dict[bytes, int] = {}
        self.num_evictions = 0  # cached blocks reused for other content, since start

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached or not): what :meth:`allocate` can hand out."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, owned or free."""
        return len(self._hash_to_block)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1] (vLLM's ``kv_cache_usage_perc``)."""
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
        return -(-num_tokens // self.block_size)

    def block_table(self, owner: str) -> list[int]:
        """The owner's block ids in token order (a copy); empty if it owns none."""
        return list(self._tables.get(owner, ()))

    def num_new_blocks_for(self, owner: str, num_tokens: int) -> int:
        """Blocks ``owner`` must still get so that its table covers ``num_tokens`` tokens."""
        have = len(self._tables.get(owner, ()))
        return max(0, self.blocks_needed(num_tokens) - have)

    def cached_prefix(self, hashes: Sequence[bytes], max_blocks: int) -> list[int]:
        """The cached blocks of the longest prefix of ``hashes`` (block hashes of a sequence, in
        order), at most ``max_blocks`` of them; empty when caching is off. Changes nothing."""
        if not self.enable_caching:
            return []
        found = []
        for block_hash in hashes[:max_blocks]:
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def can_allocate(self, owner: str, num_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Whether :meth:`allocate` of ``num_tokens`` (taking the ``cached`` prefix blocks first)
        would succeed: the new blocks plus the cached ones that are free now must be free."""
        new = max(0, self.num_new_blocks_for(owner, num_tokens) - len(cached))
        return new + sum(1 for b in cached if self._ref_counts[b] == 0) <= self.num_free_blocks

    # ---- changes -------------------------------------------------------------------------
    def allocate(self, owner: str, num_tokens: int, cached: Sequence[int] = ()) -> list[int]:
        """Grow ``owner``'s block table to cover ``num_tokens`` tokens.

        Args:
            owner: the request id.
            num_tokens: tokens the table must cover.
            cached: blocks from :meth:`cached_prefix` to take first (only for an owner without
                blocks): their reference counts go up and they leave the free LRU list.
        Returns:
            The newly allocated (not cached) block ids, possibly none.
        Raises:
            RuntimeError: the pool has too few free blocks (callers check :meth:`can_allocate`
                first and preempt).
            ValueError: ``cached`` for an owner that already holds blocks.
        """
        if not self.can_allocate(owner, num_tokens, cached):
            raise RuntimeError(
                f"out of KV blocks: {owner!r} needs {self.num_new_blocks_for(owner, num_tokens)}, "
                f"{self.num_free_blocks} free of {self.num_blocks}"
            )
        table = self._tables.setdefault(owner, [])
        if cached:
            if table:
                raise ValueError(f"{owner!r} already holds blocks; cached prefix blocks come first")
            for block_id in cached:
                if self._ref_counts[block_id] == 0:
                    del self._cached_free[block_id]
                self._ref_counts[block_id] += 1
            table.extend(cached)
        new = [self._pop_free() for _ in range(self.num_new_blocks_for(owner, num_tokens))]
        for block_id in new:
            self._ref_counts[block_id] = 1
        table.extend(new)
        return new

    def _pop_free(self) -> int:
        """A free block for new content: a never-cached one first, else evict the least recently
        freed cached block (its hash is dropped)."""
        if self._free:
            return self._free.popleft()
        block_id, _ = self._cached_free.popitem(last=False)
        del self._hash_to_block[self._block_hash[block_id]]
        self._block_hash[block_id] = None
        self.num_evictions += 1
        return block_id

    def cache_blocks(self, owner: str, hashes: Sequence[bytes], first: int) -> list[int]:
        """Register ``owner``'s blocks ``first .. len(hashes) - 1`` under ``hashes[i]`` (their
        K/V is, or is being, computed). A hash already cached under another block keeps that
        block; a block with a hash keeps it. Returns the blocks registered now (none when
        caching is off)."""
        if not self.enable_caching:
            return []
        table = self._tables[owner]
        registered = []
        for i in range(first, len(hashes)):
            block_id, block_hash = table[i], hashes[i]
            if self._block_hash[block_id] is None and block_hash not in self._hash_to_block:
                self._block_hash[block_id] = block_hash
                self._hash_to_block[block_hash] = block_id
                registered.append(block_id)
        return registered

    def uncache(self, block_ids: Sequence[int]) -> int:
        """Take these blocks out of the prefix cache (their K/V may be half written: the step that
        was to compute them failed). Owned ones stay owned; a free one (its request ended while
        the step ran) becomes a plain free block. Returns how many were cached."""
        dropped = 0
        for block_id in block_ids:
            block_hash = self._block_hash[block_id]
            if block_hash is not None:
                del self._hash_to_block[block_hash]
                self._block_hash[block_id] = None
                if block_id in self._cached_free:
                    del self._cached_free[block_id]
                    self._free.append(block_id)
                dropped += 1
        return dropped

    def free(self, owner: str) -> int:
        """Release every block ``owner`` holds; returns how many became free."""
        table = self._tables.pop(owner, None)
        if not table:
            return 0
        released = 0
        # Freed blocks join their list in reverse order, so the tail of a sequence (least likely
        # to be shared later) is reused first, as vLLM does.
        for block_id in reversed(table):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                if self._block_hash[block_id] is None:
                    self._free.append(block_id)
                else:
                    self._cached_free[block_id] = None  # most recently freed: evicted last
                released += 1
        return released

    def truncate(self, owner: str, num_tokens: int) -> int:
        """Shrink ``owner``'s block table to cover ``num_tokens`` tokens (speculative decoding: the
        blocks that held only rejected drafts); returns how many blocks were released. They hold
        no cached prefix (drafts are never registered), so they go back to the plain free list.

        Raises ``RuntimeError`` if a released block is in the prefix cache (accounting broken)."""
        table = self._tables.get(owner)
        keep = self.blocks_needed(num_tokens)
        if not table or len(table) <= keep:
            return 0
        released = table[keep:]
        del table[keep:]
        for block_id in reversed(released):
            if self._block_hash[block_id] is not None:
                raise RuntimeError(f"block {block_id} of {owner!r} is in the prefix cache; drafts never are")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)
        return len(released)

    def reset_prefix_cache(self) -> int:
        """Drop every cached block that no request holds (vLLM's ``reset_prefix_cache``); returns
        how many. Held blocks keep their hashes."""
        dropped = list(self._cached_free)
        for block_id in dropped:
            del self._hash_to_block[self._block_hash[block_id]]
            self._block_hash[block_id] = None
            self._free.append(block_id)
        self._cached_free.clear()
        return len(dropped)

    def owners(self) -> list[str]:
        return list(self._tables)

    def check_integrity(self) -> None:
        """Prove that no block is leaked or owned twice and the cache is consistent; raise
        ``AssertionError`` otherwise.

        Invariants: each block is either free (ref count 0, in exactly one free list: the
        cached one iff it has a hash) or owned (ref count equal to the number of tables listing
        it, in no free list); a block shared by several tables is a cached one; the hash table
        and the blocks' hashes mirror each other.
        """
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            raise AssertionError("a block appears twice in the free queue")
        if free_set & set(self._cached_free):
            raise AssertionError("a block is in both free lists")
        owners_of = [0] * self.num_blocks
        for owner, table in self._tables.items():
            if len(set(table)) != len(table):
                raise AssertionError(f"{owner!r} lists a block twice: {table}")
            for block_id in table:
                owners_of[block_id] += 1
        for block_id in range(self.num_blocks):
            count, ref, block_hash = owners_of[block_id], self._ref_counts[block_id], self._block_hash[block_id]
            if count != ref:
                raise AssertionError(f"block {block_id}: ref count {ref} but {count} owners")
            if ref > 1 and block_hash is None:
                raise AssertionError(f"block {block_id} is owned {ref} times but is no cached block")
            free = block_id in free_set or block_id in self._cached_free
            if free == (ref > 0):
                state = "free and owned" if ref else "neither free nor owned (leaked)"
                raise AssertionError(f"block {block_id} is {state}")
            if ref == 0 and (block_id in self._cached_free) != (block_hash is not None):
                raise AssertionError(f"free block {block_id} is in the wrong free list")
            if block_hash is not None and self._hash_to_block.get(block_hash) != block_id:
                raise AssertionError(f"block {block_id}'s hash maps to block {self._hash_to_block.get(block_hash)}")
        if len(self._hash_to_block) != sum(h is not None for h in self._block_hash):
            raise AssertionError("the hash table lists blocks that hold no hash")
        if not self.enable_caching and self._hash_to_block:
            raise AssertionError("blocks are cached with caching off")
