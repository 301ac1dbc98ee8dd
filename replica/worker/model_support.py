"""Which transformers models Carpool's engine can serve, decided at start from the model's config
and modules, before a KV cache is allocated.

Carpool keeps one thing between a request's steps: each attention layer's K and V, in its paged
cache, and its attention is plain causal softmax attention (optionally within a sliding window at
least ``max_model_len`` long, :func:`replica.attention.op.set_max_model_len`). A model that needs
anything else would start and then give wrong tokens or fail every request, so it is refused here
with a ``ValueError`` that names what it needs. What a layer passes to the attention function
when a forward runs is checked again there (:func:`replica.attention.op.paged_attention_forward`),
and :func:`probe_attention` runs one forward at start to see how the layers call it.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from transformers import AttentionInterface

from replica.attention.backend import AttentionMetadata, DecodeStep, to_device
from replica.attention.op import (
    ATTENTION_NAME,
    cache_layers,
    paged_attention_forward,
    register_paged_attention,
    running_step,
)

logger = logging.getLogger(__name__)

# transformers' names for the layers Carpool's attention computes (``config.layer_types``).
SERVED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


def check_supported(model: torch.nn.Module) -> None:
    """Refuse a model whose layers need what Carpool does not implement:

    * layer types other than full or sliding-window attention (``config.layer_types``): chunked
      attention (Llama 4), sparse "indexed" attention (DeepSeek V3.2), linear attention and hybrid
      Mamba/attention layers (Qwen3-Next, Falcon-H1, Bamba);
    * a causal convolution (an ``nn.Conv1d`` among the decoder's layers: Mamba mixers, gated
      delta nets, short convolutions), whose state over past tokens Carpool's cache does not keep;
    * ALiBi position biases (``config.alibi``: Falcon), which transformers adds through the
      attention mask;
    * Llama 4's attention temperature tuning (``attn_temperature_tuning``), which reads positions
      from transformers' own cache;
    * logit soft-capping (a layer's ``attn_logit_softcapping``: Gemma 2), attention sinks (a
      ``sinks`` parameter: GPT-OSS) or bidirectional attention (``is_causal`` False: BERT and
      RoBERTa loaded as causal LMs without ``is_decoder``) in a decoder attention layer
      (:func:`~replica.attention.op.cache_layers`);
    * no such decoder attention layer at all (Bloom, MPT: attention in the model's own code).

    Raises:
        ValueError: naming the model type and what it needs.
    """
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(text, "model_type", None) or getattr(config, "model_type", type(model).__name__)
    needs = []
    other_layers = sorted(set(getattr(text, "layer_types", None) or ()) - SERVED_LAYER_TYPES)
    if other_layers:
        needs.append(f"layers of type {', '.join(other_layers)}")
    if getattr(text, "alibi", False):
        needs.append("ALiBi position biases")
    if getattr(text, "attn_temperature_tuning", False):
        needs.append("attention temperature tuning")
    layers = cache_layers(model)
    convolutions = sorted({type(m).__name__ for stack in _decoder_stacks(model, layers) for m in stack.modules() if _has_conv1d(m)})
    if convolutions:
        needs.append(f"a state carried between steps ({', '.join(convolutions)})")
    for module in layers:
        if getattr(module, "attn_logit_softcapping", None) is not None:
            needs.append(f"logit soft-capping ({module.attn_logit_softcapping})")
        if getattr(module, "sinks", None) is not None:
            needs.append("attention sinks")
        if getattr(module, "is_causal", True) is False:
            needs.append("bidirectional attention (an encoder, not a decoder)")
        if needs:
            break
    if needs:
        raise ValueError(
            f"{model_type}: its attention needs {' and '.join(dict.fromkeys(needs))}, which Carpool does not implement"
        )
    if not layers:
        raise ValueError(
            f"{model_type}: none of its layers attends through transformers' attention interface (an attention "
            f"module with an integer layer_idx); attention computed in the model's own code (as Bloom's and "
            f"MPT's ALiBi attention is) cannot keep its K/V in Carpool's paged cache"
        )


def _decoder_stacks(model: torch.nn.Module, layers: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The ``ModuleList``s that hold the decoder's layers (any of ``layers`` below them), not a
    multimodal model's vision or audio encoder. Where no attention layer is found (a pure SSM),
    the whole model."""
    if not layers:
        return [model]
    ids = {id(m) for m in layers}
    return [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and any(id(x) in ids for x in m.modules())]


def _has_conv1d(module: torch.nn.Module) -> bool:
    return any(isinstance(child, torch.nn.Conv1d) for child in module.children())


@torch.inference_mode()
def probe_attention(runner) -> bool:
    """Run one eager forward of ``runner`` (a ``ModelRunner`` with its KV cache attached, not yet
    compiled) on two one-token sequences in the spare block, through a wrapper of
    :func:`~replica.attention.op.paged_attention_forward` that counts each layer's calls, and check
    that every layer with a KV cache calls it exactly once. The step is planned on the backend
    and also passed as a :class:`~replica.attention.backend.DecodeStep`; returns whether every layer got
    that keyword argument (some, such as Falcon's and StableLM's, do not pass transformers'
    attention arguments on: their steps then always go through the backend, without CUDA graphs).

    Raises:
        ValueError: a layer computes attention itself (no call: its K/V would never be cached),
            calls it more than once (DiffLlama's two value halves would overwrite each other's
            cache), or passes keys, values or queries of another shape than the config gives the
            cache (multi-head latent attention's value head size), naming the model type.
        NotImplementedError: from :func:`~replica.attention.op.paged_attention_forward`, for what a
            layer passes that Carpool's attention does not compute.
    """
    n, spare = 2, runner.num_blocks
    step = AttentionMetadata(
        query_start=np.arange(n + 1, dtype=np.int64), query_lens=np.ones(n, dtype=np.int64),
        context_lens=np.zeros(n, dtype=np.int64), seq_lens=np.ones(n, dtype=np.int64),
        block_tables=np.full((n, 2), spare, dtype=np.int64), slot_mapping=np.full(n, runner.padding_slot, dtype=np.int64),
        num_tokens=n,
    )
    runner.backend.plan(step)
    slots, tables, lens = to_device([step.slot_mapping, step.block_tables, step.seq_lens], runner.device)
    decode = DecodeStep(slots, tables, lens, block_size=runner.block_size)
    calls: dict[int, list] = {}

    def counting(module, query, key, value, *args, **kwargs):
        entry = calls.setdefault(id(module), [0, True])
        entry[0] += 1
        entry[1] = entry[1] and kwargs.get("carpool_decode") is decode
        cache = tuple(module.carpool_key_cache.shape[1:])  # (num_kv_heads, head_dim) from the config
        if (key.shape[1], key.shape[-1]) != cache or (value.shape[1], value.shape[-1]) != cache or query.shape[-1] != cache[1]:
            raise ValueError(
                f"{model_type}: its attention layers give queries of head size {query.shape[-1]}, keys of "
                f"{tuple(key.shape[1:2]) + tuple(key.shape[-1:])} and values of "
                f"{tuple(value.shape[1:2]) + tuple(value.shape[-1:])} (heads, head size), where its config "
                f"gives the cache {cache}: Carpool's KV cache holds the config's K/V heads, and one head size for "
                f"queries, keys and values"
            )
        return paged_attention_forward(module, query, key, value, *args, **kwargs)

    model_type = getattr(runner.model.config, "model_type", type(runner.model).__name__)
    ids = torch.zeros(1, n, dtype=torch.long, device=runner.device)
    layers = cache_layers(runner.model)
    for layer in layers:  # the probe's sequences are one token long: any sliding window covers them
        layer.carpool_max_model_len = 1
    AttentionInterface.register(ATTENTION_NAME, counting)
    try:
        with running_step(runner.backend):
            runner.model(input_ids=ids, position_ids=torch.zeros_like(ids), use_cache=False, logits_to_keep=1, carpool_decode=decode)
    finally:
        register_paged_attention()
        for layer in layers:  # set_max_model_len gives the real length once the engine knows it
            del layer.carpool_max_model_len
    counts = [calls.get(id(m), [0, False])[0] for m in layers]
    if any(c == 0 for c in counts):
        raise ValueError(
            f"{model_type}: its attention layers compute attention themselves instead of calling "
            f"transformers' attention interface, which Carpool needs to keep their K/V"
        )
    if any(c > 1 for c in counts):
        raise ValueError(
            f"{model_type}: its attention layers call attention {max(counts)} times in a step, over one "
            f"KV cache, which Carpool does not implement"
        )
    passed = all(calls[id(m)][1] for m in layers)
    if not passed:
        logger.warning(
            "%s: its attention layers do not pass on transformers' attention arguments, so every step "
            "attends through the %s backend (no decode path traced into the compiled model, no CUDA graphs)",
            model_type, runner.backend.name,
        )
    return passed
