"""Settings, with defaults and validation in one place (pydantic).

``EngineConfig`` is what one replica's engine needs; the serving settings build on it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


class EngineConfig(BaseModel):
    """One replica's engine: model, batch shape, KV cache and scheduling policy."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: str = Field(DEFAULT_MODEL, description="Hub id or local folder of a decoder-only transformers model.")
    tokenizer: str | None = Field(None, description="Tokenizer id or folder; defaults to the model's.")
    dtype: str = Field(
        "auto",
        description="Weights and KV dtype: auto (bfloat16), bfloat16, float16 or float32.",
    )
    device: str = Field("cpu", description="torch device: cpu, cuda or cuda:N.")
    max_num_seqs: int = Field(32, ge=1, description="Seats: requests running in one batch at most.")
    max_num_batched_tokens: int = Field(
        512, ge=1, description="Token budget of one step (prefill chunks plus decodes)."
    )
    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV block.")
    num_blocks: int | None = Field(
        None, ge=1, description="KV blocks in the pool; overrides kv_cache_memory when set."
    )
    kv_cache_memory: int | None = Field(
        None,
        ge=1,
        description=(
            "Bytes for the KV cache. Default: 1 GiB on CPU; on CUDA, gpu_memory_utilization of the "
            "device minus what is in use after loading the model."
        ),
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="CUDA only: fraction of device memory Carpool may use in all."
    )
    max_model_len: int | None = Field(
        None,
        ge=2,
        description="Prompt + output tokens per request at most; default the model's context length, capped by the KV pool.",
    )
    scheduling_policy: Literal["continuous", "static"] = Field(
        "continuous", description="continuous (iteration-level) batching, or the static baseline."
    )

    @model_validator(mode="after")
    def _check(self) -> "EngineConfig":
        from replica.model_loader import resolve_dtype  # keeps the names in one place

        resolve_dtype(self.dtype, self.device)
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        return self
