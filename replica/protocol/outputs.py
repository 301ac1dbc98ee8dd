"""What the engine hands back: a request's finish reason, logprobs, per-step deltas and final outputs.

Plain data, no torch or Ray: the ingress receives these over the delta channel (shaped like vLLM's).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class FinishReason(str, enum.Enum):
    """Why a request stopped, with the string OpenAI and vLLM use for it."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # cancelled by the client or the server

    def __str__(self) -> str:  # so that f"{reason}" gives "stop"
        return self.value


@dataclass
class TokenLogprobs:
    """Log-probabilities for one sampled position.

    ``logprob`` is the sampled token's log-probability under the model's raw distribution
    (log-softmax of the logits before temperature, penalties or truncation, as vLLM reports it);
    ``top`` holds the ``logprobs`` most likely ``(token_id, logprob)`` pairs, best first.
    """

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class CompletionOutput:
    """One generated sequence. ``text`` excludes special tokens and, by default, the stop string."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What ``LLM.generate`` returns per prompt (shaped like vLLM's ``RequestOutput``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict[str, float] = field(default_factory=dict)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # with SamplingParams.prompt_logprobs
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (vLLM's field)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class EmbeddingOutput:
    """One prompt's embedding (vLLM's ``EmbeddingOutput``): float32 values."""

    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """What ``LLM.embed`` returns per prompt (shaped like vLLM's ``EmbeddingRequestOutput``)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class EngineOutput:
    """A request's delta after one engine step: what streaming consumers receive.

    ``new_token_ids`` / ``new_text`` are the tokens and text that became final in this step
    (text held back while it could still be the start of a stop string is emitted later).
    ``error`` is set (and ``finish_reason`` is ``abort``) when the engine ended this request
    because of an internal error in its own processing or in its step's forward.
    ``prompt_logprobs`` (requests that ask for them) comes once, with the request's first delta:
    one entry per prompt token, ``None`` for the first.
    ``embedding`` (embedding requests, :mod:`replica.protocol.pooling_params`) comes with the
    finished delta: the pooled vector, float32 values. ``num_cached_tokens``: the prompt tokens
    its first prefix-cache lookup found computed (0 before it, or without a hit).
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprobs] | None
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_output_tokens: int
    error: str | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    embedding: list[float] | None = None
    num_cached_tokens: int = 0

    def merged(self, later: "EngineOutput") -> "EngineOutput":
        """This delta followed by ``later`` (of the same request) as one delta: tokens, text and
        logprobs concatenated, the finish state and counts of ``later``."""
        logprobs = None
        if self.new_logprobs is not None or later.new_logprobs is not None:
            logprobs = (self.new_logprobs or []) + (later.new_logprobs or [])
        return EngineOutput(
            request_id=self.request_id,
            new_token_ids=self.new_token_ids + later.new_token_ids,
            new_text=self.new_text + later.new_text,
            new_logprobs=logprobs,
            finished=later.finished,
            finish_reason=later.finish_reason,
            stop_reason=later.stop_reason,
            num_prompt_tokens=later.num_prompt_tokens,
            num_output_tokens=later.num_output_tokens,
            error=later.error,
            prompt_logprobs=self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs,
            embedding=later.embedding if later.embedding is not None else self.embedding,
            num_cached_tokens=later.num_cached_tokens,
        )


def merge_queued(item: EngineOutput, queue: Any) -> tuple[EngineOutput, Any]:
    """``item`` merged with the deltas of the same request already waiting in ``queue`` (an
    ``asyncio.Queue``), so that a consumer slower than the engine gets one delta per wake-up, not
    one per token. Stops at the finished delta, or at the first item that is not a
    :class:`EngineOutput` (an error, a marker), which it takes off the queue and returns as the
    second value (None if there was none) for the caller to handle next."""
    while not item.finished and not queue.empty():
        later = queue.get_nowait()
        if not isinstance(later, EngineOutput):
            return item, later
        item = item.merged(later)
    return item, None
