"""Speculative decoding settings (vLLM's ``speculative_config`` keys), validated at start (pydantic).

``EngineConfig.speculative_config`` holds one; ``carpool serve --speculative-config '{...}'`` and
``LLM(speculative_config={...})`` take its keys as JSON or a dict. Plain data, no torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# More drafts per step than this cost more rows than any acceptance rate repays (a request's
# expected tokens per step is at most 1 / (1 - acceptance)); vLLM warns past a handful too.
MAX_SPECULATIVE_TOKENS = 16


class SpeculativeConfig(BaseModel):
    """How drafts are proposed and how many per step (vLLM's keys; ``adaptive`` is Carpool's).

    Raises (``pydantic.ValidationError``, a ``ValueError``, naming the key): an unknown ``method``,
    ``num_speculative_tokens`` below 1 or above :data:`MAX_SPECULATIVE_TOKENS`,
    ``prompt_lookup_min`` above ``prompt_lookup_max``, ``draft_model`` without ``model``, an
    unknown key. A draft model whose vocabulary or tokenizer differs from the target's is refused
    when the engine loads it (``replica.spec_decode.draft_model``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)  # true is not 1, "no" not false

    method: Literal["ngram", "draft_model"] = Field(
        description="ngram: prompt lookup (drafts copied from the request's own prompt and output); "
        "draft_model: a smaller model with the target's tokenizer proposes them."
    )
    num_speculative_tokens: int = Field(
        description="Drafts proposed per request and step at most.", ge=1, le=MAX_SPECULATIVE_TOKENS
    )
    prompt_lookup_min: int = Field(2, ge=1, description="ngram: the shortest suffix matched.")
    prompt_lookup_max: int = Field(5, ge=1, description="ngram: the longest suffix matched (tried first).")
    model: str | None = Field(None, description="draft_model: hub id or local folder of the draft model.")
    adaptive: bool = Field(
        True,
        description="Choose each step how many drafts pay (from the measured step cost by rows and each "
        "request's acceptance), down to none; False always proposes num_speculative_tokens where it can.",
    )

    @model_validator(mode="after")
    def _check(self) -> "SpeculativeConfig":
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) is above prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError("model: method draft_model needs the draft model's hub id or folder")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("model: method ngram takes no model (use method draft_model)")
        return self
