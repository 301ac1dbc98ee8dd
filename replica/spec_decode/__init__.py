"""Speculative decoding: proposers (prompt lookup, a draft model), the planner that decides when
drafts pay, and the engine's :class:`~replica.spec_decode.speculator.Speculator` (``docs/speculative-decoding.md``)."""

from __future__ import annotations

from replica.config.engine_config import EngineConfig
from replica.spec_decode.speculator import Speculator

__all__ = ["Speculator", "make_speculator"]


def make_speculator(config: EngineConfig, runner, max_model_len: int) -> Speculator | None:
    """The engine's speculator for ``config.speculative_config`` (None without one). A draft
    model is loaded here, next to ``runner`` (the target's), sharing its block tables.

    Raises:
        ValueError: the draft model cannot be found, or its vocabulary or tokenizer differs from the target's.
    """
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "draft_model":
        from replica.spec_decode.draft_model import DraftModelProposer

        return Speculator(spec, DraftModelProposer(spec, config, runner, max_model_len))
    return Speculator(spec)
