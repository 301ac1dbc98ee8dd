"""Which engine a model runs on, and how a pooling model pools: read from its folder.

* :func:`is_pooling_model`: vLLM's ``--runner auto`` rule. A model whose ``config.json``
  architectures name a causal LM (``*ForCausalLM``, ``*LMHeadModel``, ``*ForConditionalGeneration``)
  runs on the paged generation engine (which also embeds: last-token pooling,
  :mod:`replica.worker.pooler`); any other (``BertModel``, ``*EmbeddingModel``,
  ``*ForTextEncoding``, ``*Model``: vLLM's table for ``--convert embed``) runs on the pooling
  engine (:mod:`replica.pooling.engine`).
* :func:`read_pooling_config`: a sentence-transformers folder's pooling, from its ``modules.json``
  (the ``sentence_transformers.models.Pooling`` module's folder, and whether a
  ``sentence_transformers.models.Normalize`` module follows) and that folder's ``config.json``
  (``pooling_mode_mean_tokens``, ``pooling_mode_cls_token``, ``pooling_mode_lasttoken``), and
  ``sentence_bert_config.json``'s ``max_seq_length``: a few lines of JSON, so
  sentence-transformers itself is not a dependency. A folder without them pools as vLLM's
  defaults for the architecture: CLS for encoders, the last token for decoders.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

_GENERATIVE_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
_POOLING_MODULE = "sentence_transformers.models.Pooling"
_NORMALIZE_MODULE = "sentence_transformers.models.Normalize"


@dataclass(frozen=True)
class PoolingConfig:
    """How a pooling model turns its last hidden states ``[tokens, hidden]`` into one vector.

    Attributes:
        pooling: ``mean`` (over the prompt's tokens), ``cls`` (the first token) or ``last``.
        normalize: whether the model's own pipeline L2-normalizes (a ``Normalize`` module).
        max_seq_length: the longest input the model was trained on (sentence-transformers'
            ``max_seq_length``; vLLM's ``max_model_len`` for it), or None.
    """

    pooling: Literal["mean", "cls", "last"]
    normalize: bool
    max_seq_length: int | None = None


def _architectures(model_path: str) -> list[str]:
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return []
    return list(json.loads(config.read_text()).get("architectures") or [])


def is_pooling_model(model_path: str) -> bool:
    """Whether the model folder's architectures name no causal LM (see the module docstring);
    a folder without ``config.json`` or without architectures is a generation model."""
    names = _architectures(model_path)
    return bool(names) and not any(name.endswith(_GENERATIVE_SUFFIXES) for name in names)


def read_pooling_config(model_path: str) -> PoolingConfig:
    """The folder's :class:`PoolingConfig` (see the module docstring).

    Raises:
        ValueError: a ``Pooling`` module whose mode is none of mean, CLS or last token (max
            pooling, weighted mean: not served), or that combines several.
    """
    folder = Path(model_path)
    sbert = folder / "sentence_bert_config.json"
    max_seq_length = json.loads(sbert.read_text()).get("max_seq_length") if sbert.is_file() else None
    modules_file = folder / "modules.json"
    modules = json.loads(modules_file.read_text()) if modules_file.is_file() else []
    pooling_module = next((m for m in modules if m.get("type") == _POOLING_MODULE), None)
    if pooling_module is None:
        default = "last" if not is_pooling_model(model_path) else "cls"
        return PoolingConfig(default, normalize=True, max_seq_length=max_seq_length)
    settings = json.loads((folder / pooling_module.get("path", "") / "config.json").read_text())
    modes = {
        "mean": settings.get("pooling_mode_mean_tokens", False),
        "cls": settings.get("pooling_mode_cls_token", False),
        "last": settings.get("pooling_mode_lasttoken", False),
    }
    others = [k for k, v in settings.items() if k.startswith("pooling_mode_") and v and k not in (
        "pooling_mode_mean_tokens", "pooling_mode_cls_token", "pooling_mode_lasttoken")]
    chosen = [mode for mode, on in modes.items() if on]
    if others or len(chosen) != 1:
        raise ValueError(f"{folder}: pooling {sorted(chosen + others)} is not served (one of mean, CLS or last token)")
    normalize = any(m.get("type") == _NORMALIZE_MODULE for m in modules)
    return PoolingConfig(chosen[0], normalize=normalize, max_seq_length=max_seq_length)
