"""GPTQ checkpoints (AutoGPTQ's and GPTQModel's ``gptq`` and ``gptq_v2`` formats) rewritten as
compressed-tensors ones, tensor by tensor: a converter for the ``compressed-tensors`` package's
``convert_checkpoint`` (its ``Converter`` protocol; the package ships AutoAWQ's, not GPTQ's), which
:mod:`replica.quant.convert` runs once per checkpoint.

A GPTQ linear layer of ``K`` inputs and ``N`` outputs stores, for ``b``-bit values (``f = 32 /
b`` per int32; ``G`` groups of ``group_size`` inputs, or one where ``group_size`` is -1):

* ``qweight`` int32 ``[K / f, N]``: value ``q[k, n]`` in bits ``b * (k % f)`` of word ``[k // f, n]``;
* ``qzeros`` int32 ``[G, N / f]``: zero point ``z[g, n]`` in bits ``b * (n % f)`` of word ``[g, n
  // f]``, stored as ``z - 1`` in the ``gptq`` (v1) format (read as ``(stored + 1) mod 2^b``) and
  as ``z`` in ``gptq_v2``;
* ``scales`` fp16 ``[G, N]``; ``g_idx`` int32 ``[K]``, the group of each input (``k //
  group_size``, unless the checkpoint was quantized in activation order, ``desc_act``);

and its weights are ``w[n, k] = scales[g, n] * (q[k, n] - z[g, n])``, ``g = g_idx[k]`` (AutoGPTQ's
``dequantize_weight``; GPTQModel's ``TorchQuantLinear``). compressed-tensors writes them as signed
values ``q - 2^(b-1)`` (``weight_packed``, ``weight_shape``), ``weight_scale`` ``[N, G]``,
and ``weight_zero_point`` ``z - 2^(b-1)`` (packed along N) where the checkpoint is asymmetric. A
layer in activation order (a ``g_idx`` other than ``k // group_size``) has its inputs sorted by
group (stably: ``order = argsort(g_idx)``), so that its groups are runs of ``group_size`` inputs
as compressed-tensors 0.20 stores them (it no longer computes a ``g_idx``): ``weight_packed``
holds ``q[:, order]`` and Carpool's own tensor ``input_order`` (int32 ``[K]``) says which input
each column takes; the package alone would de-quantize such a layer's columns in that order, so
only Carpool's loader serves the copy (:func:`replica.quant.compressed_load.load_what_transformers_drops`).
"""

from __future__ import annotations

import torch

from replica.quant.checkpoint import GPTQ_BITS, GPTQ_FORMATS


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 ``[R, C]`` holding ``32 / bits`` values per word along its rows -> int16 ``[R * 32 / bits, C]``."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (packed.unsqueeze(1) >> shifts[None, :, None]) & ((1 << bits) - 1)  # [R, f, C]
    return values.reshape(-1, packed.shape[1]).to(torch.int16)


def unpack_columns(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 ``[R, C]`` holding ``32 / bits`` values per word along its columns -> int16 ``[R, C * 32 / bits]``."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [R, C, f]
    return values.reshape(packed.shape[0], -1).to(torch.int16)


class GPTQConverter:
    """The ``compressed-tensors`` package's converter protocol (``process``, ``validate``,
    ``update_config``, ``update_model_config``, ``get_dependencies``) for a GPTQ checkpoint of
    ``bits`` (4 or 8), ``group_size`` (-1: per channel), ``sym`` and ``checkpoint_format`` (or
    ``format``), from its quantization config (a dict); the
    quantized layers are those with a ``qweight`` among ``names`` (the checkpoint's tensors), the
    other linear layers are left as they are (the config ignores them).

    Raises:
        ValueError: bits, format or a layer's tensors Carpool does not convert (each message names
            them); a symmetric checkpoint whose zero points are not ``2^(bits-1)``.
    """

    def __init__(self, config: dict, names: set[str]):
        self.bits = int(config.get("bits", 4))
        self.group_size = int(config.get("group_size", 128))
        self.sym = bool(config.get("sym", True))
        self.format = config.get("checkpoint_format") or config.get("format") or "gptq"
        if self.bits not in GPTQ_BITS or self.format not in GPTQ_FORMATS:
            raise ValueError(f"GPTQ checkpoints of {self.bits} bits in format {self.format} are not served ({GPTQ_BITS} bits, {GPTQ_FORMATS})")
        self.names = names
        self.modules = sorted(name.removesuffix(".qweight") for name in names if name.endswith(".qweight"))
        if not self.modules:
            raise ValueError("the GPTQ checkpoint has no qweight tensors")

    def get_dependencies(self, weight_name: str) -> set[str]:
        if not weight_name.endswith(".qweight"):
            return set()
        module = weight_name.removesuffix(".qweight")
        return {f"{module}.{part}" for part in ("qzeros", "scales", "g_idx") if f"{module}.{part}" in self.names}

    def validate(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for name in tensors:
            if name.endswith(".qweight"):
                missing = {f"{name.removesuffix('.qweight')}.{part}" for part in ("qzeros", "scales")} - set(tensors)
                if missing:
                    raise ValueError(f"GPTQ checkpoint: {name} comes without {', '.join(sorted(missing))}")
        return self.process(tensors)

    def process(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = dict(tensors)
        for name in [name for name in tensors if name.endswith(".qweight")]:
            module = name.removesuffix(".qweight")
            parts = {part: out.pop(f"{module}.{part}", None) for part in ("qweight", "qzeros", "scales", "g_idx")}
            out.update({f"{module}.{key}": value for key, value in self._convert(module, **parts).items()})
        return out

    def _convert(self, module: str, qweight, qzeros, scales, g_idx) -> dict[str, torch.Tensor]:
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

        k, n = qweight.shape[0] * 32 // self.bits, qweight.shape[1]
        groups = 1 if self.group_size == -1 else k // self.group_size if k % self.group_size == 0 else 0
        if (qweight.dtype != torch.int32 or qzeros.dtype != torch.int32 or scales.shape != (groups, n)
                or qzeros.shape != (groups, n * self.bits // 32) or (g_idx is not None and g_idx.shape != (k,))):
            raise ValueError(
                f"GPTQ checkpoint: layer {module}'s tensors (qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
                f"scales {tuple(scales.shape)}) do not fit {self.bits}-bit groups of {self.group_size}"
            )
        if qweight.device.type == "meta":  # validate: the names and dtypes process gives
            meta = {"weight_packed": torch.int32, "weight_shape": torch.int64, "weight_scale": scales.dtype}
            meta.update({"weight_zero_point": torch.int32} if not self.sym else {})
            return {key: torch.empty(0, dtype=dtype, device="meta") for key, dtype in meta.items()}
        half = 1 << (self.bits - 1)
        q = (unpack_rows(qweight, self.bits) - half).T.contiguous().to(torch.int8)  # [N, K]
        zeros = unpack_columns(qzeros, self.bits)
        if self.format == "gptq":
            zeros = (zeros + 1) & ((1 << self.bits) - 1)
        zeros = (zeros - half).T.contiguous().to(torch.int8)  # [N, G]
        if self.sym and bool((zeros != 0).any()):
            raise ValueError(f"GPTQ checkpoint: layer {module} is symmetric (sym) but its zero points are not {half}")
        out = {}
        if g_idx is not None and not _plain(g_idx, self.group_size):  # activation order: inputs sorted by group
            order = torch.argsort(g_idx.long(), stable=True)
            if not torch.equal(g_idx.long()[order], torch.arange(k) // (k // groups)):
                raise ValueError(f"GPTQ checkpoint: layer {module}'s g_idx does not make {groups} groups of {k // groups} inputs")
            q = q[:, order].contiguous()
            out["input_order"] = order.to(torch.int32)
        out.update({
            "weight_packed": pack_to_int32(q, self.bits),
            "weight_shape": torch.tensor([n, k]),
            "weight_scale": scales.T.contiguous(),
        })
        if not self.sym:
            out["weight_zero_point"] = pack_to_int32(zeros, self.bits, packed_dim=0).contiguous()
        return out

    def update_config(self, config):
        from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

        weights = QuantizationArgs(
            num_bits=self.bits, type="int", symmetric=self.sym,
            strategy="channel" if self.group_size == -1 else "group",
            group_size=None if self.group_size == -1 else self.group_size,
        )
        return QuantizationConfig(
            config_groups={"group_0": QuantizationScheme(targets=list(self.modules), weights=weights, format="pack-quantized")},
            format="pack-quantized", quantization_status="compressed",
        )

    def update_model_config(self, model_config: dict) -> dict:
        return model_config


def _plain(g_idx: torch.Tensor, group_size: int) -> bool:
    """Whether ``g_idx`` is each input's plain group (``k // group_size``; all 0 per channel)."""
    k = g_idx.numel()
    return torch.equal(g_idx.long(), torch.arange(k) // (k if group_size == -1 else group_size))
