"""KV block accounting: a free queue of fixed-size blocks, block tables and reference counts.

Plain Python, no torch: the physical tensors live in ``replica.kv_cache``; this module only
decides which block ids a request owns. The scheme is vLLM's PagedAttention block manager
(Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with
PagedAttention", arXiv:2309.06180): a request's K/V for token ``i`` lives in block
``block_ids[i // block_size]`` at offset ``i % block_size``.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    """Hands out KV blocks of ``block_size`` tokens from a pool of ``num_blocks``.

    Reference counts let one block be shared by several owners (prefix sharing); today every
    allocation is private (ref count 1), and ``free`` decrements so that sharing can be added
    without changing the invariant checked by :meth:`check_integrity`.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1] (vLLM's ``kv_cache_usage_perc``)."""
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

    def can_allocate(self, owner: str, num_tokens: int) -> bool:
        return self.num_new_blocks_for(owner, num_tokens) <= len(self._free)

    # ---- changes -------------------------------------------------------------------------
    def allocate(self, owner: str, num_tokens: int) -> list[int]:
        """Grow ``owner``'s block table to cover ``num_tokens`` tokens.

        Returns the newly allocated block ids (possibly empty). Raises ``RuntimeError`` if the
        pool has too few free blocks (callers check :meth:`can_allocate` first and preempt).
        """
        need = self.num_new_blocks_for(owner, num_tokens)
        if need > len(self._free):
            raise RuntimeError(
                f"out of KV blocks: {owner!r} needs {need}, {len(self._free)} free of {self.num_blocks}"
            )
        table = self._tables.setdefault(owner, [])
        new = [self._free.popleft() for _ in range(need)]
        for block_id in new:
            self._ref_counts[block_id] = 1
        table.extend(new)
        return new

    def free(self, owner: str) -> int:
        """Release every block ``owner`` holds; returns how many went back to the free queue."""
        table = self._tables.pop(owner, None)
        if not table:
            return 0
        released = 0
        # Freed blocks go to the back of the queue in reverse order, so the tail of a sequence
        # (least likely to be shared later) is reused first, as vLLM does.
        for block_id in reversed(table):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)
                released += 1
        return released

    def owners(self) -> list[str]:
        return list(self._tables)

    def check_integrity(self) -> None:
        """Prove that no block is leaked or owned twice; raise ``AssertionError`` otherwise.

        Invariants: each block is either free (ref count 0, in the free queue exactly once) or
        owned (ref count equal to the number of tables listing it, not in the free queue).
        """
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            raise AssertionError("a block appears twice in the free queue")
        owners_of = [0] * self.num_blocks
        for owner, table in self._tables.items():
            if len(set(table)) != len(table):
                raise AssertionError(f"{owner!r} lists a block twice: {table}")
            for block_id in table:
                owners_of[block_id] += 1
        for block_id in range(self.num_blocks):
            count, ref = owners_of[block_id], self._ref_counts[block_id]
            if count != ref:
                raise AssertionError(f"block {block_id}: ref count {ref} but {count} owners")
            if ref > 1:
                raise AssertionError(f"block {block_id} is owned {ref} times without sharing")
            if (block_id in free_set) == (ref > 0):
                state = "free and owned" if ref else "neither free nor owned (leaked)"
                raise AssertionError(f"block {block_id} is {state}")
