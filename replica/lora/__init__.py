"""Multi-LoRA: many PEFT LoRA adapters on one copy of the base weights, mixed in one step.

* :mod:`replica.lora.adapter`: read and check one adapter's PEFT files (``peft``, ``safetensors``);
* :mod:`replica.lora.registry`: the adapters this engine knows, in host memory (LRU, ``max_cpu_loras``);
* :mod:`replica.lora.layers`: every linear layer of the decoder layers adds its token's adapter
  delta, from ``max_loras`` device slots of stacked weights;
* :mod:`replica.lora.slots`: which adapter is in which slot (LRU), and each step's token slots.

The scheduler keeps at most ``max_loras`` distinct adapters running (``replica.core.scheduler``);
a block's prefix hash starts from its adapter's root (``replica.protocol.prefix_hash``).
"""
