"""The physical paged KV cache: one K and one V tensor per layer, addressed by slot.

A *slot* is one token's place in the pool: ``slot = block_id * block_size + offset`` (vLLM's
``slot_mapping``). Each layer's cache is stored flat as ``[num_blocks * block_size, num_kv_heads,
head_dim]`` so that writing a step's new K/V is one ``index_copy_`` and reading a request's
context is one gather through its block table.
"""

from __future__ import annotations

import torch


def kv_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one block takes over all layers, K and V: ``2 * L * block_size * H_kv * D * itemsize``."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


class PagedKVCache:
    """K/V tensors for ``num_blocks`` blocks of ``block_size`` tokens in every layer.

    Shapes: ``key_cache[layer]`` and ``value_cache[layer]`` are
    ``[num_blocks * block_size, num_kv_heads, head_dim]``.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        self.key_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.value_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.key_cache + self.value_cache)

    def write(
        self, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store new K/V: ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` at ``slot_mapping`` ``[num_tokens]``."""
        self.key_cache[layer].index_copy_(0, slot_mapping, key.to(self.key_cache[layer].dtype))
        self.value_cache[layer].index_copy_(0, slot_mapping, value.to(self.value_cache[layer].dtype))

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Read contexts through block tables.

        Args:
            block_tables: ``[num_seqs, max_blocks]`` block ids (pad with any valid id; the
                caller masks positions past each sequence's length).
        Returns:
            keys, values: ``[num_seqs, num_kv_heads, max_blocks * block_size, head_dim]``.
        """
        num_seqs, max_blocks = block_tables.shape
        flat_ids = block_tables.reshape(-1)
        out = []
        for cache in (self.key_cache[layer], self.value_cache[layer]):
            # index_select on [num_blocks, block_size * H_kv * D] rows: one contiguous copy per block.
            blocks = cache.view(self.num_blocks, -1).index_select(0, flat_ids)
            out.append(
                blocks.view(num_seqs, max_blocks * self.block_size, self.num_kv_heads, self.head_dim)
                .transpose(1, 2)
            )
        return out[0], out[1]
