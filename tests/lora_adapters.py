"""Random LoRA adapters made with the real ``peft`` library, and peft's own greedy tokens for them.

``make_adapter`` writes an adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``)
for a base model folder, as ``PeftModel.save_pretrained`` writes it. Its A and B are random
(``init_lora_weights=False``: peft leaves both with ``nn.Linear``'s default init, so the adapter is
not the identity), and each module's B is rescaled so that its weight delta ``scaling * B @ A``
has ``strength`` times the Frobenius norm of the base weight: large enough that greedy tokens
change on most prompts, small enough that the model stays the base model plus an edit (a real
model keeps writing plausible text).

``peft_greedy`` is the reference the engine's tokens are held to: ``PeftModel.from_pretrained`` on
the fp32 base, ``generate(do_sample=False)``, one prompt at a time without padding, stopping at EOS
or ``max_new_tokens`` (the fidelity tests' convention: ``tests/engine/test_fidelity.py``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import torch

from tests.helpers import TEST_DEVICE

ALL_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _load_base(base_path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32, attn_implementation="sdpa")


def make_adapter(
    base_path: str,
    out_dir: str | os.PathLike,
    *,
    r: int = 8,
    target_modules: Sequence[str] = ALL_LINEARS,
    alpha: float = 16,
    seed: int = 0,
    use_rslora: bool = False,
    strength: float = 0.1,
) -> str:
    """Write a random PEFT LoRA adapter for the model in ``base_path`` to ``out_dir``; returns the
    folder (as a string). ``strength``: each module's ``|scaling * B @ A| / |W|`` (Frobenius)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = _load_base(base_path)
    config = LoraConfig(
        r=r, lora_alpha=alpha, target_modules=list(target_modules), init_lora_weights=False,
        use_rslora=use_rslora, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, config)
    with torch.no_grad():
        for module in model.modules():
            if not hasattr(module, "lora_A") or "default" not in getattr(module, "lora_A", {}):
                continue
            a = module.lora_A["default"].weight
            b = module.lora_B["default"].weight
            w = module.get_base_layer().weight
            delta = module.scaling["default"] * (b @ a)
            b.mul_(strength * w.norm() / delta.norm())
    model.save_pretrained(str(out_dir))
    return str(out_dir)


def edit_adapter_config(adapter_dir: str | os.PathLike, **changes) -> None:
    """Change fields of an adapter's ``adapter_config.json`` in place (e.g. ``use_rslora``)."""
    path = os.path.join(str(adapter_dir), "adapter_config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def peft_greedy(
    base_path: str,
    adapter_dir: str | None,
    prompt_token_ids: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int],
    *,
    with_logprobs: bool = False,
):
    """peft's greedy tokens (fp32) for each prompt, under the adapter in ``adapter_dir`` (the base
    model when None): ``PeftModel.from_pretrained(base, adapter_dir).generate(do_sample=False)``,
    one prompt at a time, no padding; a request stops at EOS (kept as its last token) or after
    ``max_new_tokens`` (one for all prompts, or one per prompt).

    With ``with_logprobs``, returns ``(tokens, logprobs)`` where ``logprobs[i][k]`` is the
    log-softmax row (a CPU tensor) at output position ``k`` of prompt ``i``: to show how close a
    near-tie was when the engine picks another token.
    """
    model = _load_base(base_path)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    model = model.to(TEST_DEVICE).eval()
    eos = model.generation_config.eos_token_id if adapter_dir is None else model.base_model.model.generation_config.eos_token_id
    pad = eos[0] if isinstance(eos, (list, tuple)) else eos
    limits = [max_new_tokens] * len(prompt_token_ids) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    tokens, logprobs = [], []
    with torch.no_grad():
        for ids, limit in zip(prompt_token_ids, limits, strict=True):
            out = model.generate(
                input_ids=torch.tensor([list(ids)], device=TEST_DEVICE),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=TEST_DEVICE),
                max_new_tokens=limit, do_sample=False, pad_token_id=pad,
                output_scores=with_logprobs, return_dict_in_generate=True,
            )
            tokens.append(out.sequences[0, len(ids):].tolist())
            if with_logprobs:
                logprobs.append([torch.log_softmax(s[0].float(), -1).cpu() for s in out.scores])
    return (tokens, logprobs) if with_logprobs else tokens


def explain_mismatch(got: Sequence[int], expected: Sequence[int], logprobs) -> str:
    """Where ``got`` leaves ``expected``, and peft's logprobs of both tokens there (a near-tie
    shows as two logprobs within ~1e-5 of each other)."""
    k = next((i for i, (g, e) in enumerate(zip(got, expected)) if g != e), min(len(got), len(expected)))
    if k >= len(logprobs) or k >= len(got) or k >= len(expected):
        return f"lengths differ at position {k}: got {len(got)} tokens, expected {len(expected)}"
    row = logprobs[k]
    return (f"first difference at output position {k}: got {got[k]} (peft logprob {row[got[k]].item():.7f}), "
            f"expected {expected[k]} (peft logprob {row[expected[k]].item():.7f})")
