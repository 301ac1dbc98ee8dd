"""Embeddings on encoder models (BERT-like): the pooling engine (:mod:`replica.pooling.engine`) and
how a model's folder says it pools (:mod:`replica.pooling.config`). A generative model embeds on
its own paged engine instead (:mod:`replica.worker.pooler`); ``docs/embeddings.md`` has both."""

from __future__ import annotations

from typing import TYPE_CHECKING

from replica.config.engine_config import EngineConfig
from replica.config.model_files import resolve_model_path
from replica.pooling.config import is_pooling_model

if TYPE_CHECKING:
    from replica.engine.metrics import EngineMetrics
    from replica.pooling.engine import PoolingEngine


def check_pooling_settings(config: EngineConfig) -> bool:
    """Whether ``config.model`` is a pooling model (:func:`~replica.pooling.config.is_pooling_model`:
    vLLM's ``--runner auto`` rule; a ``.gguf`` file is a generation model). ``carpool serve`` calls
    it before starting Ray, so that a refused setting is said at once.

    Raises:
        ValueError: a pooling model with settings the pooling engine does not run
            (``tensor_parallel_size`` > 1, LoRA, ``quantization``, speculative decoding, the
            ``"priority"`` scheduling policy: it takes requests in arrival order).
    """
    if config.model.endswith(".gguf") or not is_pooling_model(resolve_model_path(config.model, weights=False)):
        return False
    if (config.tensor_parallel_size > 1 or config.enable_lora or config.quantization or config.speculative_config
            or config.scheduling_policy == "priority"):
        raise ValueError(
            f"model {config.model!r} is an embedding model (pooling engine): tensor_parallel_size > 1, LoRA, "
            "quantization, speculative decoding and the priority scheduling policy are for generation models "
            "(the pooling engine takes its requests in arrival order)"
        )
    return True


def pooling_engine_for(config: EngineConfig, metrics: EngineMetrics | None = None) -> PoolingEngine | None:
    """A :class:`~replica.pooling.engine.PoolingEngine` when ``config.model`` is a pooling model,
    else None (the model runs on :class:`~replica.engine.llm_engine.LLMEngine`).

    Raises:
        ValueError: what :func:`check_pooling_settings` raises; what the engine raises.
    """
    if not check_pooling_settings(config):
        return None
    from replica.pooling.engine import PoolingEngine

    return PoolingEngine(config, metrics=metrics)


__all__ = ["check_pooling_settings", "pooling_engine_for"]
