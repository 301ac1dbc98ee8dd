"""Carpool's replica engine: continuous batching over a paged KV cache on transformers models.

Public entry points: :class:`LLM` (offline), :class:`LLMEngine` (step level),
:class:`AsyncLLMEngine` (asyncio streaming, used by the Serve replica), :class:`SamplingParams`.
"""

from replica.request import CompletionOutput, FinishReason, RequestOutput, StepOutput
from replica.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "LLMEngine",
    "AsyncLLMEngine",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "StepOutput",
    "FinishReason",
]


def __getattr__(name):  # lazy: importing the package must not pull in torch
    if name == "LLM":
        from replica.llm import LLM

        return LLM
    if name == "LLMEngine":
        from replica.engine import LLMEngine

        return LLMEngine
    if name == "AsyncLLMEngine":
        from replica.async_engine import AsyncLLMEngine

        return AsyncLLMEngine
    raise AttributeError(name)
