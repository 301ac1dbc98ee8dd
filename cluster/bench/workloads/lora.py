"""The ``lora-routing`` bench's inputs: random LoRA adapters made with ``peft``, and a seeded,
skewed stream of requests over them.

* :func:`make_adapters`: ``num`` random PEFT LoRA adapters for one base model, each in its own
  folder, as ``PeftModel.save_pretrained`` writes them. The base is loaded once; each adapter's A
  and B are drawn from its own seed, and B is scaled so that each module's weight delta
  ``scaling * B @ A`` has ``strength`` times the Frobenius norm of the base weight (enough to change
  greedy tokens, little enough that the model still writes text).
* :func:`lora_requests`: which adapter each request names. ``hot`` adapters share ``hot_fraction``
  of the requests, the others the rest, evenly, drawn from ``seed`` (a couple of hot adapters and a
  long tail, as a multi-tenant server sees them). Output lengths are drawn from ``seed`` too,
  uniformly in [``max_tokens`` / 2, 3 ``max_tokens`` / 2]: equal lengths would end the requests of
  a closed loop in waves, every slot idle at once, which no real traffic does.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from cluster.bench.workloads.base import PROMPTS

TARGET_MODULES = ("q_proj", "v_proj")
"""Modules the adapters adapt: those of Llama-style models (SmolLM2, Llama, Qwen, Mistral)."""


def adapter_names(num: int) -> list[str]:
    """``["lora-0", "lora-1", ...]``: the adapters' names (their model ids), hot ones first."""
    return [f"lora-{i}" for i in range(num)]


def make_adapters(
    model_path: str, folder: str | Path, num: int, *, rank: int = 8, seed: int = 0, strength: float = 0.15,
    target_modules: tuple[str, ...] = TARGET_MODULES,
) -> dict[str, str]:
    """Write ``num`` random rank-``rank`` adapters for the model in ``model_path`` under
    ``folder`` (one sub-folder each, named as :func:`adapter_names`); returns ``{name: folder}``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(target_modules), init_lora_weights=False,
                        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    layers = [m for m in model.modules() if "default" in getattr(m, "lora_A", {})]
    out = {}
    for i, name in enumerate(adapter_names(num)):
        generator = torch.Generator().manual_seed(seed * 1000 + i)
        with torch.no_grad():
            for m in layers:
                a, b = m.lora_A["default"].weight, m.lora_B["default"].weight
                a.copy_(torch.randn(a.shape, generator=generator))
                b.copy_(torch.randn(b.shape, generator=generator))
                delta = m.scaling["default"] * (b @ a)
                b.mul_(strength * m.get_base_layer().weight.norm() / delta.norm())
        path = Path(folder) / name
        model.save_pretrained(str(path))
        out[name] = str(path)
    return out


@dataclass
class LoRARequest:
    """One request of the bench: its index, the adapter it names, its prompt, its output tokens."""

    index: int
    adapter: str
    prompt: str
    max_tokens: int


def lora_requests(
    num_requests: int, num_adapters: int, *, hot: int = 2, hot_fraction: float = 0.6, max_tokens: int = 16, seed: int = 0
) -> list[LoRARequest]:
    """``num_requests`` requests in the order they are sent, each naming one of ``num_adapters``
    adapters: the first ``hot`` adapters draw ``hot_fraction`` of them in all, the others the rest
    (uniformly within each group; with ``hot`` 0 or ``num_adapters``, uniformly over all), and
    generating between ``max_tokens // 2`` and ``3 * max_tokens // 2`` tokens (at least 1).

    Raises ``ValueError`` for counts or a fraction out of range."""
    if num_requests < 1 or num_adapters < 1 or not 0 <= hot <= num_adapters or not 0 <= hot_fraction <= 1:
        raise ValueError(
            f"lora-routing workload: need requests >= 1, adapters >= 1, 0 <= hot <= adapters and "
            f"0 <= hot_fraction <= 1; got {num_requests}, {num_adapters}, {hot}, {hot_fraction}"
        )
    names = adapter_names(num_adapters)
    if hot in (0, num_adapters):
        weights = [1.0] * num_adapters
    else:
        weights = [hot_fraction / hot] * hot + [(1 - hot_fraction) / (num_adapters - hot)] * (num_adapters - hot)
    rng = random.Random(seed)
    chosen = rng.choices(names, weights=weights, k=num_requests)
    lengths = [rng.randint(max(1, max_tokens // 2), max(1, 3 * max_tokens // 2)) for _ in chosen]
    return [
        LoRARequest(i, name, f"{PROMPTS[i % len(PROMPTS)]} (request {i})", n)
        for i, (name, n) in enumerate(zip(chosen, lengths))
    ]
