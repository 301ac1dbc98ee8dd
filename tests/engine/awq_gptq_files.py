"""AWQ and GPTQ checkpoints for the tests, packed as AutoAWQ (``WQLinear_GEMM.from_linear``) and
AutoGPTQ (``QuantLinear.pack``) pack them, from integers chosen here: each decoder linear layer
of a model rounded to the nearest value per group (with zero points where asymmetric), written
beside a plain checkpoint of the weights ``s * (q - z)`` those integers stand for (float32), the
reference transformers runs. Neither packer is installable here (AutoAWQ is archived; GPTQModel
needs a newer torch), so the packing is written out from their code, and the reading under test
(the ``compressed-tensors`` package's AWQ converter, Carpool's GPTQ one) never shares it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's order of 8 columns within a word


def _integers(weight: torch.Tensor, bits: int, group: int, sym: bool, order: torch.Tensor | None):
    """Round to nearest per group of ``group`` inputs (in ``order`` where given: activation order):
    ``(q [N, K], scales fp16 [N, G], zeros [N, G])``, ``q`` and ``zeros`` in ``0 .. 2^bits - 1``,
    with GPTQ's rule (symmetric: ``s = 2 max |w| / maxq``, ``z = (maxq + 1) / 2``; else ``s = (max
    - min) / maxq``, ``z = round(-min / s)``, the range widened to hold 0)."""
    maxq = 2**bits - 1
    n, k = weight.shape
    w = weight.float() if order is None else weight.float()[:, order]
    groups = w.reshape(n, k // group, group)
    if sym:
        scale = groups.abs().amax(-1) * 2 / maxq
        zero = torch.full_like(scale, (maxq + 1) // 2)
    else:
        low, high = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
        scale = (high - low) / maxq
        zero = torch.round(-low / scale.clamp(min=1e-8))
    scale = scale.clamp(min=1e-6).half()
    q = torch.clamp(torch.round(groups / scale.float()[..., None]) + zero[..., None], 0, maxq).reshape(n, k)
    if order is not None:  # back to the inputs' own order
        q = q[:, torch.argsort(order)]
    return q.to(torch.int64), scale, zero.to(torch.int64)


def _pack(values: torch.Tensor, bits: int, dim: int, order: list[int] | None = None) -> torch.Tensor:
    """``values`` (non-negative, below ``2^bits``) packed ``32 / bits`` to an int32 word along
    ``dim``, the ``i``-th value of each run of ``32 / bits`` at bits ``bits * i`` (AWQ: the run's
    value ``order[i]`` there)."""
    per = 32 // bits
    moved = values.movedim(dim, -1)
    runs = moved.reshape(*moved.shape[:-1], -1, per)
    if order is not None:
        runs = runs[..., order]
    words = (runs << (bits * torch.arange(per))).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def _write(source: str | Path, target: Path, quantization_config: dict, layer) -> tuple[Path, Path]:
    """``source``'s decoder linears replaced by ``layer(name, weight, bias) -> (tensors, weight)``
    (the packed tensors and the weights they stand for), written to ``target / "quantized"``
    with ``quantization_config``, and to ``target / "reference"`` as a plain checkpoint of those
    weights. Returns both folders."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    packed: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in name:
            tensors, weight = layer(name, module.weight.detach())
            packed.update({f"{name}.{key}": value for key, value in tensors.items()})
            module.weight.data = weight
    reference, quantized = target / "reference", target / "quantized"
    model.save_pretrained(reference)
    AutoTokenizer.from_pretrained(source).save_pretrained(reference)
    shutil.copytree(reference, quantized)
    state = load_file(quantized / "model.safetensors")
    state = {key: value for key, value in state.items() if key.removesuffix(".weight") + ".qweight" not in packed}
    save_file({**state, **packed}, quantized / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (quantized / "config.json").write_text(json.dumps(config, indent=2))
    return quantized, reference


def write_awq(source: str | Path, target: Path, group_size: int = 32) -> tuple[Path, Path]:
    """An AutoAWQ GEMM checkpoint of ``source`` (4 bits, zero points, groups of ``group_size``):
    ``qweight`` int32 ``[K, N / 8]`` and ``qzeros`` ``[G, N / 8]`` (8 columns a word in AutoAWQ's
    order), ``scales`` fp16 ``[G, N]``. Returns ``(quantized, reference)`` folders (:func:`_write`)."""

    def layer(name, weight):
        q, scale, zero = _integers(weight, 4, group_size, sym=False, order=None)
        tensors = {"qweight": _pack(q.T, 4, 1, AWQ_ORDER), "qzeros": _pack(zero.T, 4, 1, AWQ_ORDER), "scales": scale.T.contiguous()}
        return tensors, _dequantized(q, scale, zero, group_size)

    config = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": None}
    return _write(source, target, config, layer)


def write_gptq(source: str | Path, target: Path, *, bits: int = 4, group_size: int = 32, sym: bool = True,
               desc_act: bool = False, checkpoint_format: str = "gptq") -> tuple[Path, Path]:
    """A GPTQ checkpoint of ``source`` as AutoGPTQ packs it: ``qweight`` int32 ``[K * bits / 32, N]``
    (along K), ``qzeros`` ``[G, N * bits / 32]`` (along N; ``z - 1`` in the ``gptq`` format, ``z``
    in ``gptq_v2``), ``scales`` fp16 ``[G, N]``, ``g_idx`` int32 ``[K]`` (a random activation order
    where ``desc_act``). Returns ``(quantized, reference)`` folders (:func:`_write`)."""
    generator = torch.Generator().manual_seed(0)

    def layer(name, weight):
        k = weight.shape[1]
        group = k if group_size == -1 else group_size
        order = torch.randperm(k, generator=generator) if desc_act else None
        q, scale, zero = _integers(weight, bits, group, sym, order)
        g_idx = torch.arange(k) // group
        if order is not None:  # input order[i] is the i-th quantized: group i // group
            g_idx = torch.empty_like(g_idx).scatter_(0, order, torch.arange(k) // group)
        stored = zero - 1 if checkpoint_format == "gptq" else zero
        tensors = {"qweight": _pack(q.T, bits, 0), "qzeros": _pack(stored.T % 2**bits, bits, 1),
                   "scales": scale.T.contiguous(), "g_idx": g_idx.to(torch.int32)}
        return tensors, _dequantized(q, scale, zero, group, g_idx)

    config = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "sym": sym, "desc_act": desc_act,
              "checkpoint_format": checkpoint_format}
    return _write(source, target, config, layer)


def _dequantized(q, scale, zero, group: int, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """``w[n, k] = s[n, g] * (q[n, k] - z[n, g])``, ``g = g_idx[k]`` (``k // group`` where None), float32."""
    g = torch.arange(q.shape[1]) // group if g_idx is None else g_idx.long()
    return scale.float()[:, g] * (q - zero[:, g]).float()
