"""The engine's configuration (:class:`EngineConfig`) and where a model's files come from.

Torch-free: the ingress and the CLI read it.
"""

from replica.config.engine_config import (
    DEFAULT_MODEL,
    DTYPE_NAMES,
    EngineConfig,
    cache_dir,
    check_dtype_name,
)
from replica.config.model_files import load_tokenizer, packaged_gguf_path, resolve_gguf_model, resolve_model_path

__all__ = [
    "DEFAULT_MODEL",
    "DTYPE_NAMES",
    "EngineConfig",
    "cache_dir",
    "check_dtype_name",
    "load_tokenizer",
    "packaged_gguf_path",
    "resolve_gguf_model",
    "resolve_model_path",
]
