"""Request state and the outputs the engine hands back.

Terms follow vLLM: a request's tokens are ``prompt_token_ids + output_token_ids``;
``num_computed_tokens`` of them already have their K/V in the paged cache; the block table
(``block_ids``) lists the KV blocks the request owns, in order.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from replica.sampling_params import SamplingParams
from replica.structured_output import DEAD_END


class FinishReason(str, enum.Enum):
    """Why a request stopped, with the string OpenAI and vLLM use for it."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # cancelled by the client or the server

    def __str__(self) -> str:  # so that f"{reason}" gives "stop"
        return self.value


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


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


@dataclass(eq=False)
class Request:
    """One generation request as the engine tracks it.

    ``prompt_logprobs`` (when ``sampling_params.prompt_logprobs`` is set) holds entry ``p - 1`` for
    prompt token ``p >= 1``, filled chunk by chunk as the prompt is prefilled (kept across a
    preemption, so a recompute does not add them twice).

    ``num_tokens`` = prompt + output tokens known so far; a request is *prefilling* while
    ``num_computed_tokens < num_tokens - 1`` would leave known tokens without K/V. After a
    preemption by recompute, ``num_computed_tokens`` goes back to 0 and the prompt *and* the
    output so far are prefilled again.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # Static policy only: finished, but keeps its seat and row until its batch ends.
    is_padding: bool = False
    finish_step: int | None = None
    generator: Any = None  # torch.Generator for seeded sampling, owned by the model runner
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs_sent: bool = False  # handed out in a StepOutput already
    # Prefix caching: the chained hash of each full block of prompt + output known so far (filled
    # lazily by the scheduler), and how many of the request's blocks are in the prefix cache.
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    # Structured output: the constraint's state (replica.structured_output.Grammar), or None.
    grammar: Any = None
    # Async scheduling: tokens sampled by a step still in flight, not yet in output_token_ids.
    # num_computed_tokens already counts the positions that step computes (Scheduler.advance).
    num_pending: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, index: int) -> int:
        """Token id at position ``index`` of prompt + output."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

def check_stop(request: Request, token_id: int, max_model_len: int) -> tuple[FinishReason | None, int | str | None]:
    """Whether ``request`` ends on ``token_id``, just appended to its output: ``(reason,
    stop_reason)``, or ``(None, None)`` if it goes on. In order: a structured-output constraint
    that refuses the token (``ABORT``, ``DEAD_END``) or is complete (``STOP``); past
    ``min_tokens``, EOS (unless ``ignore_eos``) or a stop token id (``STOP``, with that id);
    ``max_tokens`` or ``max_model_len`` tokens reached (``LENGTH``). It advances the request's
    grammar by the token. Stop strings are the detokenizer's (:mod:`replica.detokenizer`)."""
    params = request.sampling_params
    if request.grammar is not None:  # structured output: complete, or a dead end
        if not request.grammar.accept(token_id):
            return FinishReason.ABORT, DEAD_END
        if request.grammar.is_finished:
            return FinishReason.STOP, None
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token_id in request.eos_token_ids:
            return FinishReason.STOP, None
        if token_id in params.stop_token_ids:
            return FinishReason.STOP, token_id
    if request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_model_len:
        return FinishReason.LENGTH, None
    return None, None


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

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class StepOutput:
    """A request's delta after one engine step: what streaming consumers receive.

    ``new_token_ids`` / ``new_text`` are the tokens and text that became final in this step
    (text held back while it could still be the start of a stop string is emitted later).
    ``error`` is set (and ``finish_reason`` is ``abort``) when the engine ended this request
    because of an internal error in its own processing or in its step's forward.
    ``prompt_logprobs`` (requests that ask for them) comes once, with the request's first delta:
    one entry per prompt token, ``None`` for the first.
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

    @classmethod
    def of(
        cls, request: "Request", token_ids: list[int], text: str, logprobs: list[TokenLogprobs] | None
    ) -> "StepOutput":
        """``request``'s delta of ``token_ids`` and ``text``, with its finish state and counts now."""
        reason = request.finish_reason
        return cls(
            request_id=request.request_id,
            new_token_ids=token_ids,
            new_text=text,
            new_logprobs=logprobs,
            finished=request.is_finished,
            finish_reason=reason.value if reason is not None else None,
            stop_reason=request.stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
        )

    def merged(self, later: "StepOutput") -> "StepOutput":
        """This delta followed by ``later`` (of the same request) as one delta: tokens, text and
        logprobs concatenated, the finish state and counts of ``later``."""
        logprobs = None
        if self.new_logprobs is not None or later.new_logprobs is not None:
            logprobs = (self.new_logprobs or []) + (later.new_logprobs or [])
        return StepOutput(
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
        )


def merge_queued(item: StepOutput, queue: Any) -> tuple[StepOutput, Any]:
    """``item`` merged with the deltas of the same request already waiting in ``queue`` (an
    ``asyncio.Queue``), so that a consumer slower than the engine gets one delta per wake-up, not
    one per token. Stops at the finished delta, or at the first item that is not a
    :class:`StepOutput` (an error, a marker), which it takes off the queue and returns as the
    second value (None if there was none) for the caller to handle next."""
    while not item.finished and not queue.empty():
        later = queue.get_nowait()
        if not isinstance(later, StepOutput):
            return item, later
        item = item.merged(later)
    return item, None
