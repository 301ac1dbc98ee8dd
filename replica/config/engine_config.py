"""The engine's settings, with defaults and validation in one place (pydantic).

``EngineConfig`` is what one replica's engine needs; ``cluster.config.ServeConfig`` composes it
with the serving settings.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field, model_validator

from replica.config.speculative_config import SpeculativeConfig

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    """Carpool's cache folder (``$CARPOOL_CACHE_DIR`` or ``~/.cache/carpool``): converted models,
    built CPU kernels, inductor's compiled graphs."""
    return Path(os.environ.get("CARPOOL_CACHE_DIR", Path.home() / ".cache" / "carpool"))


# dtype names accepted in settings -> torch dtype attribute ("auto" is resolved per device by
# replica.worker.model_loader.resolve_dtype: bfloat16 where the device computes it well, else float16 on a
# GPU and float32 on a CPU).
DTYPE_NAMES = {
    "auto": "auto", "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "float32": "float32", "fp32": "float32", "float": "float32",
}


def check_dtype_name(dtype: str) -> str:
    """The torch dtype attribute a dtype setting names (``"auto"`` stays ``"auto"``).

    Raises ``ValueError`` for an unknown name.
    """
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_NAMES)}, got {dtype!r}")
    return DTYPE_NAMES[dtype]


BATCHING_POLICIES = ("continuous", "static")


def deprecated_batching_name(value: object, where: str) -> bool:
    """Whether ``value``, given to ``where`` as a scheduling policy, is one of the former names of
    the batching policy (``"continuous"``, ``"static"``, taken until ``scheduling_policy`` became
    vLLM's fcfs/priority); if so, warn (``FutureWarning``, which end users see) that it now goes
    to ``batching_policy``."""
    if value not in BATCHING_POLICIES:
        return False
    warnings.warn(
        f"{where} {value!r} is deprecated: continuous and static are batching policies now "
        f"(batching_policy / --batching-policy {value}); scheduling_policy is fcfs or priority",
        FutureWarning, stacklevel=2,
    )
    return True


def former_names_moved(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` (engine settings, one source: a config file's, the command line's) with a
    deprecated ``scheduling_policy: continuous|static`` moved to ``batching_policy`` (with a
    warning), ``scheduling_policy`` left to its default (fcfs). Apply it to each source before
    merging them, so that a later source's ``scheduling_policy`` never hides an earlier one's
    batching policy.

    Raises:
        ValueError: ``batching_policy`` is given too, and differs.
    """
    if not deprecated_batching_name(settings.get("scheduling_policy"), "scheduling_policy"):
        return settings
    settings = dict(settings)
    old = settings.pop("scheduling_policy")
    if settings.setdefault("batching_policy", old) != old:
        raise ValueError(
            f"scheduling_policy {old!r} (a deprecated name of batching_policy) contradicts "
            f"batching_policy {settings['batching_policy']!r}: give batching_policy alone"
        )
    return settings


class EngineConfig(BaseModel):
    """One replica's engine: model, batch shape, KV cache, batching and scheduling policies."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: str = Field(
        DEFAULT_MODEL,
        description="Hub id or local folder of a transformers model, or a .gguf file: a decoder-only LM, or an "
        "embedding model (an encoder such as BertModel, served for /v1/embeddings only).",
    )
    tokenizer: str | None = Field(None, description="Tokenizer id or folder; defaults to the model's.")
    dtype: str = Field(
        "auto",
        description=(
            "Weights and KV dtype: auto, bfloat16, float16 or float32. auto: bfloat16 on GPUs that have "
            "it (else float16), on CPUs with oneDNN's bf16 path (AVX512 or AVX-NE-CONVERT) and on CPUs "
            "with AVX2 and FMA where Carpool's CPU kernels build (its linear kernel reads bf16 weights); "
            "else float32."
        ),
    )
    device: str = Field("cpu", description="torch device: cpu, cuda or cuda:N.")
    quantization: Literal["gguf", "int8", "int4", "compressed-tensors", "awq", "gptq"] | None = Field(
        None,
        description=(
            "gguf: compute the linear layers from the model's GGUF file as stored (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, "
            "Q4_K, Q5_K and Q6_K blocks, so Q4_K_M and Q5_K_M files too, on Carpool's CPU kernels, AVX512 or AVX2; CPU; "
            "each rank its part of the blocks under tensor parallelism); the model is a .gguf file or the default model (its package ships a "
            "Q4_1 file). int8, int4: quantize a full-precision model's linear layers at load into blocks "
            "of 32 weights (int8: Q8_0; int4: Q4_1, the output layer Q8_0) on the same kernels, each rank "
            "its own shard under tensor parallelism. compressed-tensors: a checkpoint of that format (W4A16, "
            "W8A16, W8A8 int8) computed from its integer weights on the same kernels (each rank its part; W8A8 at tensor_parallel_size 1). "
            "awq, gptq: an AutoAWQ (4-bit GEMM) or GPTQ (4 or 8 bits) checkpoint, converted once into "
            "compressed-tensors and served as one. "
            "Unset: a compressed-tensors, AWQ or GPTQ checkpoint is served as with its method where the kernels run "
            "(else de-quantized at load); GGUF weights are de-quantized to dtype at load."
        ),
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description=(
            "Devices (GPUs; on CPU, processes of one core each) one replica's model is sharded over "
            "with transformers' tensor-parallel plan; the model's query and KV heads must divide by it."
        ),
    )
    max_num_seqs: int = Field(64, ge=1, description="Seats: requests running in one batch at most.")
    max_num_batched_tokens: int = Field(
        512, ge=1, description="Token budget of one step (prefill chunks plus decodes)."
    )
    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV block.")
    num_blocks: int | None = Field(
        None, ge=1, description="KV blocks in the pool; overrides kv_cache_memory when set."
    )
    kv_cache_memory: ByteSize | None = Field(
        None,
        ge=1,
        description=(
            "Bytes for the KV cache, a number or with a unit (1GiB, 512MiB, 2GB). Default: 1 GiB on "
            "CPU; on CUDA, gpu_memory_utilization of the device minus what is in use after loading the model."
        ),
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="CUDA only: fraction of device memory Carpool may use in all."
    )
    max_model_len: int | None = Field(
        None,
        ge=2,
        description=(
            "Prompt + output tokens per request at most; default the model's context length, capped by "
            "the KV pool and by the model's sliding window if it has one (a larger value is refused there)."
        ),
    )
    attention_backend: Literal["auto", "reference", "cpu", "cuda"] = Field(
        "auto",
        description=(
            "auto: the device's fast backend (cpu: compiled decode kernel and one batched prefill "
            "call; cuda: FlashInfer if installed, else torch's varlen flash attention); reference: "
            "one SDPA call per sequence (slow, the tests' oracle)."
        ),
    )
    compile: bool = Field(
        True,
        description=(
            "torch.compile the decoder layers (and the CPU decode kernel); compiled code is cached "
            "on disk. False runs eagerly (vLLM's enforce_eager)."
        ),
    )
    cuda_graphs: bool = Field(
        True,
        description=(
            "CUDA with compile only: capture decode-only steps as CUDA graphs at start (batch sizes "
            "2, 4, 8, then multiples of 8 up to max_num_seqs) and replay them; False launches every "
            "kernel of every step."
        ),
    )
    async_scheduling: bool | None = Field(
        None,
        description=(
            "Schedule and prepare step N+1 while step N runs (vLLM's async scheduling), continuous "
            "policy only: on CUDA the host's work overlaps the GPU's; a step's tokens are then "
            "read one step later, and a request that stops on a token (EOS, a stop string) costs "
            "one thrown-away row. Tokens are the same as without it. None (the default): on for "
            "CUDA, where it gave 1.57x the tok/s on an H200 (docs/bench/gpu-h200.md), off on CPU, "
            "where every op is synchronous and there is nothing to overlap."
        ),
    )
    enable_prefix_caching: bool = Field(
        True,
        description=(
            "Keep the K/V of full blocks after their request ends and reuse it for later prompts that "
            "start with the same tokens (automatic prefix caching); False recomputes every prompt."
        ),
    )
    loop_thread_nice: int = Field(
        4,
        ge=0,
        le=19,
        description=(
            "Added to the engine loop thread's nice value (Linux, where nice is per thread; capped "
            "at 19). When steps keep every core busy, the replica's event loop, the ingress and "
            "Serve's proxy then run as soon as they wake, so tokens and new requests do not wait "
            "for a step's time slice; 0 leaves the thread alone."
        ),
    )
    batching_policy: Literal["continuous", "static"] = Field(
        "continuous", description="continuous (iteration-level) batching, or the static baseline."
    )
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs",
        description=(
            "The waiting queue's order (vLLM's): fcfs, first come first served (a request's priority "
            "must be 0), or priority: by each request's priority (lower first), then arrival; a waiting "
            "request may preempt running ones of lower priority. Its former values, continuous and "
            "static, are deprecated names of batching_policy."
        ),
    )
    stall_timeout_s: float = Field(
        60.0,
        gt=0,
        description=(
            "Seconds the engine loop may go without finishing a step while requests are queued; "
            "past it the replica's health check fails and Serve replaces the replica."
        ),
    )
    speculative_config: SpeculativeConfig | None = Field(
        None,
        description=(
            "Speculative decoding (vLLM's keys: method ngram or draft_model, num_speculative_tokens, "
            "prompt_lookup_min/max, model): drafts are checked in the ordinary step and only the tokens "
            "the model would produce are kept; steps then run synchronously (no async scheduling)."
        ),
    )
    enable_lora: bool = Field(
        False,
        description=(
            "Serve LoRA adapters (PEFT format) on this base model: a request names its adapter "
            "(LoRARequest; served: its model), and one step mixes adapters and the base model."
        ),
    )
    max_loras: int = Field(4, ge=1, le=64, description="LoRA: adapters on the device at once (LRU slots).")
    max_lora_rank: int = Field(16, ge=1, le=512, description="LoRA: the largest adapter rank served.")
    max_cpu_loras: int | None = Field(
        None, ge=1, description="LoRA: adapters kept in host memory (LRU, read again when needed); default max_loras."
    )
    enable_fault_injection: bool = Field(
        False, description="Testing only: allow LLMReplica.inject_stall() to wedge the engine loop on purpose."
    )

    @model_validator(mode="before")
    @classmethod
    def _former_scheduling_policies(cls, data: Any) -> Any:
        """The former names moved (:func:`former_names_moved`) before the fields are read."""
        return former_names_moved(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _check(self) -> "EngineConfig":
        check_dtype_name(self.dtype)
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        if self.quantization and DTYPE_NAMES[self.dtype] == "float16":
            raise ValueError(f"quantization {self.quantization} computes with bfloat16 or float32 activations, not float16")
        if self.quantization and self.quantization not in ("compressed-tensors", "awq", "gptq") and self.device != "cpu":
            raise ValueError(f"quantization {self.quantization} runs on device cpu for now (got device {self.device!r})")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError("enable_lora with tensor_parallel_size > 1 is not supported yet: serve adapters at tensor_parallel_size 1")
        return self
