"""The served LoRA adapters: which model ids they are, loads and unloads (``adapters.py``), and the
``LoRARegistry`` deployment every ingress replica shares (``lora_registry.py``)."""
