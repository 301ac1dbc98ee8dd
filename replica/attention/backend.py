"""The attention backend interface: a step's sequences (:class:`AttentionMetadata`) and what every backend implements."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """The sequences of one step as the backends see them (host arrays, built by the model runner).

    Sequence ``i`` computes tokens ``[query_start[i], query_start[i + 1])`` of the packed step, at
    positions ``context_lens[i] ...``; ``seq_lens[i] = context_lens[i] + query_lens[i]``. Shapes:
    ``query_start`` ``[S + 1]``; ``query_lens``, ``context_lens``, ``seq_lens`` ``[S]``;
    ``block_tables`` ``[S, W]`` (``W`` blocks cover the longest sequence; the rest of a row is
    padding); ``slot_mapping`` ``[num_tokens]`` (padding tokens of a padded step map to a spare
    slot that no block table holds). ``num_tokens`` may exceed ``query_start[-1]`` by those padding
    tokens; their attention output is zero.
    """

    query_start: np.ndarray
    query_lens: np.ndarray
    context_lens: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    slot_mapping: np.ndarray
    num_tokens: int

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    def decode_queries(self, seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Sequences ``seqs`` (indices) as one decode query per token: causal attention, one query
        at a time. Token ``j`` of sequence ``i`` reads ``i``'s block table and sees its first
        ``context_lens[i] + j + 1`` tokens.

        Returns ``(tokens, rows, lens)``, each ``[sum(query_lens[seqs])]``: the packed step's token
        index, the sequence it belongs to, and the tokens it attends to.
        """
        counts = self.query_lens[seqs]
        rows = np.repeat(seqs, counts)
        first = self.query_start[rows]
        offsets = np.arange(len(rows)) - np.repeat(np.cumsum(counts) - counts, counts)  # j within its sequence
        return first + offsets, rows, (self.context_lens[rows] + 1 + offsets).astype(self.seq_lens.dtype)


class AttentionBackend:
    """How one engine computes paged attention on its device.

    :meth:`plan` runs once per step, before the forward, with the step's :class:`AttentionMetadata`;
    :meth:`forward` runs once per layer. Subclasses implement both.

    Args:
        block_size: tokens per KV block.
        device: where the KV cache and the step's tensors live.
    """

    name = "base"
    inline_decode = False  # may a compiled model trace decode-like steps' attention (DecodeStep)?
    # Prefill chunks of at most this many (query, key) pairs each (a chunk of n new tokens over a
    # sequence of s tokens has n * s) run as decode queries (AttentionMetadata.decode_queries).
    inline_chunk_pairs = 0

    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device

    def plan(self, step: AttentionMetadata) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:  # pragma: no cover - interface
        """``query`` ``[T, H, D]``, ``key``/``value`` ``[T, H_kv, D]``; caches ``[num_slots, H_kv, D]``.
        Writes the new K/V into the caches, returns the attention output ``[T, H, D]``."""
        raise NotImplementedError


@dataclass
class DecodeStep:
    """A step whose every token attends as one decode query (a sequence's next token, or a token
    of a prefill chunk that sees its sequence up to itself: ``AttentionMetadata.decode_queries``;
    padding tokens as sequences of one token that read and write the spare slot): attention is
    then traced into the compiled layer (:func:`replica.attention.cpu_decode.decode_attention`)
    instead of going through the opaque op, which saves the op's Python work and a compiled call
    per layer.

    Shapes: ``slot_mapping`` ``[T]``, ``block_tables`` ``[T, W]``, ``seq_lens`` ``[T]``.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    block_size: int


def to_device(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """int64 host arrays as tensors on ``device``: views on CPU; on CUDA one pinned staging buffer
    and one host-to-device copy for all of them (non-blocking)."""
    if device.type == "cpu":
        return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
    sizes = [a.size for a in arrays]
    staging = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=True)
    np.concatenate([a.reshape(-1) for a in arrays], out=staging.numpy())
    flat = staging.to(device, non_blocking=True)
    return [part.view(a.shape) for part, a in zip(flat.split(sizes), arrays)]
