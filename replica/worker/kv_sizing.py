"""How large the KV pool and the sequences are: the number of blocks a byte budget holds, and the
longest sequence (``max_model_len``) the model, the pool and the attention allow."""

from __future__ import annotations

import logging

import torch

from replica.worker.kv_cache import ModelShape

logger = logging.getLogger(__name__)

# The KV budget on CPU where none is given (bytes).
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


def decide_num_blocks(
    num_blocks: int | None,
    kv_cache_memory: int | None,
    gpu_memory_utilization: float,
    bytes_per_block: int,
    device: torch.device,
    *,
    reserve: int = 0,
) -> int:
    """Blocks in the pool: ``num_blocks`` if given, else ``budget // bytes_per_block``.

    The budget (bytes) is ``kv_cache_memory`` if given; else 1 GiB on CPU, and on CUDA
    ``gpu_memory_utilization × total − memory in use after loading the model`` (vLLM's rule),
    less ``reserve`` (the CUDA graphs' memory, :func:`~replica.worker.cuda_graphs.graph_memory_reserve`).

    Raises:
        ValueError: the budget holds no block.
    """
    if num_blocks is not None:
        return num_blocks
    budget = kv_cache_memory
    if budget is None:
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            budget = int(total * gpu_memory_utilization) - (total - free) - reserve
        else:
            budget = DEFAULT_CPU_KV_CACHE_BYTES
    blocks = budget // bytes_per_block
    if blocks < 1:
        raise ValueError(f"kv_cache_memory of {budget} bytes holds no KV block ({bytes_per_block} bytes per block)")
    return int(blocks)


def decide_max_model_len(requested: int | None, shape: ModelShape, num_blocks: int, block_size: int) -> int:
    """The longest sequence (prompt + output, tokens) the engine serves: ``requested``, or by
    default the smallest of the model's context, the KV pool (``num_blocks × block_size``), its
    sliding window and its longrope short length.

    Carpool's attention has no sliding window, so a model with one is served where the window
    covers every sequence, which changes no token (transformers' mask lets query ``i`` see key
    ``j`` when ``i - j < window``). A longrope model's rotary frequencies switch for every position
    of a forward once one position passes ``original_max_position_embeddings``, so with several
    sequences in one forward a long one would change a short one's tokens; it is served below that
    length, where the short factors always apply.

    Raises:
        ValueError: ``requested`` exceeds the pool, the model's context, its sliding window or its
            longrope short length.
    """
    pool_tokens = num_blocks * block_size
    context = shape.max_position_embeddings or pool_tokens
    window, short = shape.sliding_window, shape.longrope_short_len
    cap = min((limit for limit in (window, short) if limit), default=None)
    max_model_len = requested or min(context, pool_tokens, cap or context)
    if max_model_len > pool_tokens:
        raise ValueError(
            f"max_model_len {max_model_len} exceeds the KV pool ({num_blocks} blocks × {block_size} = "
            f"{pool_tokens} tokens); raise kv_cache_memory/num_blocks or lower max_model_len"
        )
    if max_model_len > context:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's context length {context}")
    if cap and not requested and cap < min(context, pool_tokens):
        reason = "sliding window" if cap == window else "longrope short length"
        logger.warning("max_model_len is %d, the model's %s (its context: %d)", cap, reason, context)
    if window and max_model_len > window:
        raise ValueError(
            f"max_model_len {max_model_len} exceeds the model's sliding window of {window} tokens: "
            f"Carpool's attention has no sliding window, so it serves this model with max_model_len up to "
            f"{window}, where the window covers every sequence"
        )
    if short and max_model_len > short:
        raise ValueError(
            f"max_model_len {max_model_len} exceeds the model's longrope original_max_position_embeddings of "
            f"{short} tokens: past it transformers switches every position of a forward to the long rotary "
            f"factors, so batched requests would change each other's tokens; Carpool serves this model with "
            f"max_model_len up to {short}"
        )
    return max_model_len
