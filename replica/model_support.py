"""Which transformers models Carpool's engine can serve, decided at start from the model's config
and modules, before a KV cache is allocated.

Carpool keeps one thing between a request's steps: each attention layer's K and V, in its paged
cache, and its attention is plain causal softmax attention (optionally within a sliding window at
least ``max_model_len`` long, :func:`replica.attention.set_max_model_len`). A model that needs
anything else would start and then give wrong tokens or fail every request, so it is refused here
with a ``ValueError`` that names what it needs. What a layer passes to the attention function
when a forward runs is checked again there (:func:`replica.attention.paged_attention_forward`),
and every engine runs one forward at start (:func:`replica.warm_up.warm_up`).
"""

from __future__ import annotations

import torch

# transformers' names for the layers Carpool's attention computes (``config.layer_types``).
SERVED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


def check_supported(model: torch.nn.Module) -> None:
    """Refuse a model whose layers need what Carpool does not implement:

    * layer types other than full or sliding-window attention (``config.layer_types``): chunked
      attention (Llama 4), sparse "indexed" attention (DeepSeek V3.2), linear attention and hybrid
      Mamba/attention layers (Qwen3-Next, Falcon-H1, Bamba);
    * a causal convolution (an ``nn.Conv1d`` in the model: Mamba mixers, gated delta nets, short
      convolutions), whose state over past tokens Carpool's cache does not keep;
    * ALiBi position biases (``config.alibi``: Falcon), which transformers adds through the
      attention mask;
    * Llama 4's attention temperature tuning (``attn_temperature_tuning``), which reads positions
      from transformers' own cache;
    * logit soft-capping (a layer's ``attn_logit_softcapping``: Gemma 2) or attention sinks (a
      ``sinks`` parameter: GPT-OSS) in an attention layer.

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
    convolutions = sorted({type(m).__name__ for m in model.modules() if _has_conv1d(m)})
    if convolutions:
        needs.append(f"a state carried between steps ({', '.join(convolutions)})")
    for module in model.modules():
        if not is_attention(module):
            continue
        if getattr(module, "attn_logit_softcapping", None) is not None:
            needs.append(f"logit soft-capping ({module.attn_logit_softcapping})")
        if getattr(module, "sinks", None) is not None:
            needs.append("attention sinks")
        if needs:
            break
    if needs:
        raise ValueError(
            f"{model_type}: its attention needs {' and '.join(dict.fromkeys(needs))}, which Carpool does not implement"
        )


def is_attention(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a transformers attention layer (its class name ends in ``Attention``)."""
    return type(module).__name__.endswith("Attention")


def _has_conv1d(module: torch.nn.Module) -> bool:
    return any(isinstance(child, torch.nn.Conv1d) for child in module.children())
