"""One LoRA adapter read from PEFT's files and checked against the base model.

PEFT's format: ``adapter_config.json`` (a ``LoraConfig``: ``r``, ``lora_alpha``, ``target_modules``,
``rank_pattern``, ``alpha_pattern``, ``use_rslora``, ...) and ``adapter_model.safetensors`` with
``base_model.model.<module>.lora_A.weight`` ``[r, in_features]`` and ``...lora_B.weight``
``[out_features, r]`` for every adapted module. Both are read with ``peft`` itself
(``PeftConfig.from_pretrained``, ``peft.utils.load_peft_weights``), not parsed by hand.

A module's output under the adapter is PEFT's ``LoraLayer`` forward (``peft/tuners/lora/layer.py``,
``Linear.forward``): ``base(x) + lora_B(lora_A(x)) * scaling`` with ``scaling = alpha / r``, or
``alpha / sqrt(r)`` with ``use_rslora`` (Kalajdzievski 2023, "A Rank Stabilization Scaling Factor
for Fine-Tuning with LoRA"), ``r`` and ``alpha`` per module from ``rank_pattern``/``alpha_pattern``.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field

import torch

from replica.protocol.errors import LoRAAdapterError
from replica.protocol.lora_request import LoRARequest

PREFIX = "base_model.model."


@dataclass(eq=False)
class LoRAAdapter:
    """An adapter in host memory.

    ``weights[module]`` = ``(A [r, in_features], B [out_features, r], scaling)`` for each adapted
    module, named as in the base model's ``named_modules()``; ``rank`` is the largest ``r``.
    Identity is the object: a request holds its adapter, so an adapter forgotten by the registry
    (unloaded, or evicted from host memory) still serves the requests that hold it.
    """

    request: LoRARequest
    rank: int
    target_modules: list[str]
    weights: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = field(repr=False)
    digest: bytes = b""  # SHA-256 of the name, the folder, and the weights and scalings as read

    @property
    def hash_root(self) -> bytes:
        """The parent digest of the first KV block of its requests (``replica.protocol.prefix_hash``):
        from what was read, not only the name and folder, so that an adapter retrained into the same
        folder and read again (unloaded and loaded, or dropped from host memory) never meets the
        K/V its earlier weights left in the prefix cache."""
        return hashlib.sha256(b"carpool-lora-weights\0" + self.digest).digest()

    @property
    def name(self) -> str:
        return self.request.lora_name

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b, _ in self.weights.values())


def load_adapter(
    request: LoRARequest, *, linear_shapes: dict[str, tuple[int, int]], max_rank: int, dtype: torch.dtype
) -> LoRAAdapter:
    """Read and check ``request.lora_path``'s adapter.

    Args:
        linear_shapes: ``(out_features, in_features)`` of each module an adapter may adapt (the
            linear layers of the decoder layers), by name.
        max_rank: the engine's ``max_lora_rank``.
        dtype: the model's dtype; the weights are converted to it.
    Raises:
        LoRAAdapterError: naming the reason: no such folder or no adapter files in it; not a LoRA
            adapter; a PEFT feature Carpool does not serve (DoRA, trained biases, ``modules_to_save``,
            ``fan_in_fan_out``, adapted embeddings); a rank above ``max_rank``; a module the base
            does not have, or that is not one of its decoder layers' linear layers; weights whose
            shapes do not fit the module, or that hold NaN or infinite values.
    """
    try:
        return _load(request, linear_shapes=linear_shapes, max_rank=max_rank, dtype=dtype)
    except LoRAAdapterError:
        raise
    except Exception as exc:  # noqa: BLE001 — whatever else a malformed adapter trips is its fault, a 400
        raise LoRAAdapterError(f"adapter {request.lora_name!r}: cannot be read: {type(exc).__name__}: {exc}") from exc


def _load(request: LoRARequest, *, linear_shapes: dict[str, tuple[int, int]], max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    from peft import PeftConfig
    from peft.utils import load_peft_weights
    from peft.utils.other import get_pattern_key

    path, name = request.lora_path, request.lora_name
    if not name or not isinstance(name, str):
        raise LoRAAdapterError("lora_name must be a non-empty string")
    if not path or not os.path.isdir(path):
        raise LoRAAdapterError(f"adapter {name!r}: {path!r} is not a folder")
    if not os.path.isfile(os.path.join(path, "adapter_config.json")):
        raise LoRAAdapterError(f"adapter {name!r}: {path!r} has no adapter_config.json")
    try:
        config = PeftConfig.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 — any unreadable config is the adapter's fault
        raise LoRAAdapterError(f"adapter {name!r}: adapter_config.json cannot be read: {exc}") from exc
    peft_type = str(getattr(config, "peft_type", ""))
    if not peft_type.endswith("LORA") or peft_type.endswith("ADALORA"):
        raise LoRAAdapterError(f"adapter {name!r}: peft_type is {peft_type!r}; only LORA adapters are served")
    unsupported = {
        "use_dora": bool(getattr(config, "use_dora", False)),
        "bias": getattr(config, "bias", "none") != "none",
        "lora_bias": bool(getattr(config, "lora_bias", False)),
        "modules_to_save": bool(getattr(config, "modules_to_save", None)),
        "fan_in_fan_out": bool(getattr(config, "fan_in_fan_out", False)),
    }
    for key, used in unsupported.items():
        if used:
            raise LoRAAdapterError(f"adapter {name!r}: {key} is set in adapter_config.json; Carpool serves plain LoRA only")
    try:
        state = load_peft_weights(path, device="cpu")
    except Exception as exc:  # noqa: BLE001 — missing or corrupt weights
        raise LoRAAdapterError(f"adapter {name!r}: its weights cannot be read: {exc}") from exc
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        short = key.removeprefix(PREFIX)
        module, _, rest = short.rpartition(".lora_") if ".lora_" in short else short.partition(".base_layer")
        if module not in linear_shapes:  # an embedding, the head, a norm: PEFT saves their weights too
            raise LoRAAdapterError(
                f"adapter {name!r}: it adapts {module or short!r}, which is not a linear layer of the base model's "
                "decoder layers (the only layers Carpool serves adapters on)"
            )
        if rest not in ("A.weight", "B.weight"):
            raise LoRAAdapterError(f"adapter {name!r}: weight {key!r} is not a LoRA A or B matrix")
        if not torch.isfinite(tensor).all():
            raise LoRAAdapterError(f"adapter {name!r}: weight {key!r} holds NaN or infinite values")
        pairs.setdefault(module, {})[rest[0]] = tensor
    if not pairs:
        raise LoRAAdapterError(f"adapter {name!r}: its weights file holds no LoRA weights")
    weights: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(f"adapter {name!r}: module {module!r} has lora_{'A' if 'B' in ab else 'B'} missing")
        a, b = ab["A"], ab["B"]
        out_features, in_features = linear_shapes[module]
        r = a.shape[0] if a.dim() == 2 else -1
        if r < 1 or b.dim() != 2 or a.shape[1] != in_features or b.shape != (out_features, r):
            raise LoRAAdapterError(
                f"adapter {name!r}: module {module!r} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                f"the base layer needs [r, {in_features}] and [{out_features}, r]"
            )
        if r > max_rank:
            raise LoRAAdapterError(f"adapter {name!r}: rank {r} of {module!r} exceeds max_lora_rank={max_rank}")
        patterns = config.alpha_pattern or {}
        alpha = patterns.get(get_pattern_key(patterns.keys(), module), config.lora_alpha)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
            raise LoRAAdapterError(f"adapter {name!r}: lora_alpha of {module!r} is {alpha!r}, not a number")
        scaling = alpha / math.sqrt(r) if config.use_rslora else alpha / r
        weights[module] = (a.to(dtype).contiguous(), b.to(dtype).contiguous(), float(scaling))
    targets = sorted({module.rpartition(".")[2] for module in weights})
    digest = hashlib.sha256(f"{name}\0{path}".encode())
    for module, (a, b, scaling) in weights.items():
        digest.update(f"\0{module}\0{scaling!r}\0".encode())
        digest.update(a.view(torch.uint8).numpy().tobytes() + b.view(torch.uint8).numpy().tobytes())
    return LoRAAdapter(request, max(a.shape[0] for a, _, _ in weights.values()), targets, weights, digest.digest())
