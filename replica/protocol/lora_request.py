"""Which LoRA adapter a request runs with (torch-free: the router builds it, the replica reads it).

vLLM's ``LoRARequest`` (``lora_name``, ``lora_int_id``, ``lora_path``), so code written for vLLM's
``LLM.generate(..., lora_request=LoRARequest("sql", 1, "/adapters/sql"))`` runs unchanged. An
engine knows an adapter by ``(lora_name, lora_path)``: the first request that names a pair loads
the adapter's PEFT files from ``lora_path`` (``replica.lora.adapter``), later ones reuse it.
``lora_int_id`` is accepted for vLLM's sake and not used (vLLM keys adapters by it; the name and
path say the same here).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A request's adapter: ``lora_name`` (what clients call it: the request's ``model``),
    ``lora_path`` (a local folder with ``adapter_config.json`` and ``adapter_model.safetensors``)."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""

    @property
    def key(self) -> tuple[str, str]:
        """What an engine knows the adapter by: ``(lora_name, lora_path)``."""
        return (self.lora_name, self.lora_path)

    @property
    def hash_root(self) -> bytes:
        """The parent digest of the first block hash of this adapter's prompts in the router's
        prefix record (``router/routing/prefix_affinity.py``; :mod:`replica.protocol.prefix_hash`):
        the same tokens under two adapters (or an adapter and the base model) have different K/V,
        so their hashes must differ. The replica's own cache goes further and roots an adapter's
        blocks in its weights as read (``replica.lora.adapter.LoRAAdapter.hash_root``), so that an
        adapter retrained into the same folder never meets its earlier weights' K/V."""
        return hashlib.sha256(b"carpool-lora\0" + self.lora_name.encode() + b"\0" + self.lora_path.encode()).digest()
