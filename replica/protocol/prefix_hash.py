"""Block hashes for prefix caching: one digest per full KV block, chained over the blocks before it.

vLLM v1's scheme: block ``i`` of a sequence is identified by
``sha256(hash(block i-1) || token ids of block i)``, so equal hashes mean equal token prefixes up to
and including that block (not just equal blocks), and a prefix of ``k`` full blocks is found by
looking its ``k`` hashes up one after the other. The other input that changes a block's K/V is
the request's LoRA adapter: its chain starts from the adapter's own root
(``replica.lora.adapter.LoRAAdapter.hash_root``, a digest of its weights as read; vLLM mixes the adapter id into each
block's hash to the same end), so two adapters never share a block and the requests of one do.
A future input that changes K/V (multimodal inputs) must be mixed in the same way.

Plain Python (``hashlib``), no torch: the replica's block manager and the router's cache-aware
routing compute the same hashes in different processes.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT = b"carpool-prefix-v1"  # the parent of a sequence's first block


def extend_block_hashes(
    hashes: list[bytes], token_ids: Sequence[int], block_size: int, root: bytes = ROOT
) -> list[bytes]:
    """Append to ``hashes`` the digests of the full blocks of ``token_ids`` it does not cover yet.

    Args:
        hashes: the digests (32 bytes each) of the first ``len(hashes)`` blocks of ``token_ids``;
            extended in place.
        token_ids: the sequence (prompt, then output), tokens.
        block_size: tokens per block.
        root: the parent digest of the first block: :data:`ROOT`, or the request's adapter's
            (``LoRAAdapter.hash_root``; the router's record: ``LoRARequest.hash_root``).
    Returns:
        ``hashes``, now one digest per full block: ``len(token_ids) // block_size`` entries.
    """
    parent = hashes[-1] if hashes else root
    for i in range(len(hashes), len(token_ids) // block_size):
        digest = hashlib.sha256(parent)
        digest.update(array("q", token_ids[i * block_size : (i + 1) * block_size]).tobytes())
        parent = digest.digest()
        hashes.append(parent)
    return hashes


def block_hashes(token_ids: Sequence[int], block_size: int, root: bytes = ROOT) -> list[bytes]:
    """The digests of every full block of ``token_ids`` (see :func:`extend_block_hashes`)."""
    return extend_block_hashes([], token_ids, block_size, root)
