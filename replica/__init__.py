"""Carpool's replica engine: continuous batching over a paged KV cache on transformers models.

Public entry points: :class:`LLM` (offline), :class:`LLMEngine` (step level),
:class:`AsyncLLMEngine` (asyncio streaming, used by the Serve replica), :class:`SamplingParams`,
:class:`PoolingParams` (an embedding request's), :class:`LoRARequest` (a request's LoRA adapter).
The packages, lowest first: ``config`` and ``protocol`` (torch-free types), ``core`` (scheduling,
no torch), ``kernels``, ``attention``, ``sample``, ``lora`` (adapters), ``worker`` (the forward), ``engine`` (the step
loop), ``pooling`` (embedding models' engine) and ``serve`` (the Ray Serve replica); ``docs/development.md`` maps them.
"""

from replica.protocol.lora_request import LoRARequest
from replica.protocol.outputs import CompletionOutput, EmbeddingRequestOutput, EngineOutput, FinishReason, RequestOutput
from replica.protocol.pooling_params import PoolingParams
from replica.protocol.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "LLMEngine",
    "AsyncLLMEngine",
    "SamplingParams",
    "PoolingParams",
    "LoRARequest",
    "RequestOutput",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "EngineOutput",
    "FinishReason",
]


def __getattr__(name):  # lazy: importing the package must not pull in torch
    if name == "LLM":
        from replica.engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from replica.engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "AsyncLLMEngine":
        from replica.engine.async_engine import AsyncLLMEngine

        return AsyncLLMEngine
    raise AttributeError(name)
