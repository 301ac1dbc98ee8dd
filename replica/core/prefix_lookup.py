"""Looking a new request up in the prefix cache: its block hashes, made lazily
(:func:`hash_blocks`), the cached blocks it may start from (:func:`cached_prefix`), where
its next chunk starts (:func:`first_chunk_start`), and registering the blocks it fills
(:func:`register_full_blocks`). Plain functions of the scheduler's
:class:`~replica.core.block_manager.BlockManager` and a request.
"""

from __future__ import annotations

from replica.core.block_manager import BlockManager
from replica.core.request import Request
from replica.protocol.prefix_hash import extend_block_hashes


def hash_blocks(request: Request, block_size: int, num_blocks: int) -> None:
    """Make ``request.block_hashes`` cover at least its first ``num_blocks`` full blocks of
    ``block_size`` tokens (lazily: the sequence is copied only when a block is missing)."""
    if len(request.block_hashes) < num_blocks:
        extend_block_hashes(request.block_hashes, request.all_token_ids, block_size, request.hash_root)


def cached_prefix(bm: BlockManager, request: Request) -> list[int] | None:
    """The prefix-cached block ids a request that holds no blocks yet can start from: the longest
    run of its leading full blocks found in the cache, leaving at least its last known token to
    compute (its logits give the next token). None when no lookup applies: caching off, a
    request already under way, or one that asks for prompt logprobs (they need the logits of
    every prompt position, as in vLLM)."""
    if not bm.enable_caching or request.block_ids or request.num_computed_tokens:
        return None
    if request.sampling_params.prompt_logprobs is not None:
        return None
    hash_blocks(request, bm.block_size, request.num_tokens // bm.block_size)
    return bm.cached_prefix(request.block_hashes, (request.num_tokens - 1) // bm.block_size)


def first_chunk_start(bm: BlockManager, request: Request) -> tuple[list[int] | None, int]:
    """``(cached, start)``: the request's :func:`cached_prefix` and the first token its next chunk
    computes (past the cached blocks for a request that holds none yet, else
    ``num_computed_tokens``)."""
    cached = cached_prefix(bm, request)
    return cached, len(cached) * bm.block_size if cached else request.num_computed_tokens


def register_full_blocks(bm: BlockManager, request: Request, num_tokens: int) -> list[int]:
    """Register in the prefix cache ``request``'s blocks that ``num_tokens`` tokens fill, past
    those already registered (``request.num_cached_blocks``); returns the blocks newly cached
    (``BlockManager.cache_blocks``'), none with caching off."""
    full = num_tokens // bm.block_size
    if not bm.enable_caching or full <= request.num_cached_blocks:
        return []
    hash_blocks(request, bm.block_size, full)
    cached = bm.cache_blocks(request.request_id, request.block_hashes[:full], request.num_cached_blocks)
    request.num_cached_blocks = full
    return cached
