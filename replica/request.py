"""Request state, sampling parameters and the outputs the engine hands back.

Terms follow vLLM: a request's tokens are ``prompt_token_ids + output_token_ids``;
``num_computed_tokens`` of them already have their K/V in the paged cache; the block table
(``block_ids``) lists the KV blocks the request owns, in order.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import Any

from replica.structured_output import StructuredOutputsParams


class FinishReason(str, enum.Enum):
    """Why a request stopped, with the string OpenAI and vLLM use for it."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # cancelled by the client or the server

    def __str__(self) -> str:  # so that f"{reason}" gives "stop"
        return self.value


# Most entries a ``logit_bias`` may hold (OpenAI documents no cap; this bounds the work per request).
MAX_LOGIT_BIAS_ENTRIES = 1024
# Range of a ``logit_bias`` value (OpenAI's): -100 effectively bans the token, 100 forces it.
LOGIT_BIAS_LIMIT = 100.0


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SamplingParams:
    """Per-request sampling parameters (vLLM's names and defaults).

    Validation happens at construction: a bad value raises ``ValueError`` whose message starts
    with the field name, e.g. ``"top_p must be in (0, 1], got 1.5"``.

    Attributes:
        n: sequences to generate for the prompt (``LLM.generate`` and the API fan them out
            into ``n`` engine requests; a seeded request's i-th sequence uses ``seed + i``).
        max_tokens: most output tokens to generate (tokens, >= 0; 0 scores the prompt only: it is
            prefilled, its ``prompt_logprobs`` computed, and the request ends with ``length``).
        min_tokens: EOS and ``stop_token_ids`` are masked until this many tokens exist.
        temperature: 0 means greedy; otherwise logits are divided by it (>= 0).
        top_k: keep the k most likely tokens; 0 or -1 disables.
        top_p: nucleus sampling mass in (0, 1] (Holtzman et al. 2019, arXiv:1904.09751).
        min_p: drop tokens whose probability is below ``min_p * p_max``, in [0, 1].
        presence_penalty / frequency_penalty: OpenAI's additive penalties in [-2, 2], over the
            request's own output tokens only.
        repetition_penalty: CTRL's multiplicative penalty (Keskar et al. 2019, arXiv:1909.05858)
            over the request's prompt and output tokens, > 0 (1 disables).
        seed: a private generator per request, so samples never depend on batch mates.
        stop: strings that end generation; matched across token boundaries on the text.
        stop_token_ids: token ids that end generation (kept in ``token_ids``).
        ignore_eos: keep generating past EOS (benchmarks).
        logprobs: if set, return the sampled token's logprob and this many top alternatives.
        prompt_logprobs: if set, return each prompt token's logprob given the tokens before it
            (the first prompt token has none) and this many top alternatives, in [0, 20]. Only
            requests that set it pay for the extra logits rows.
        include_stop_str_in_output: keep the matched stop string in the text.
        skip_special_tokens: drop special tokens (e.g. EOS) from the text.
        logit_bias: ``{token id: bias}`` added to the raw logits before anything else (penalties,
            min_tokens, temperature); OpenAI's: biases in [-100, 100] (-100 effectively bans the
            token, 100 forces it), at most ``MAX_LOGIT_BIAS_ENTRIES`` entries. Logprobs stay
            those of the unbiased logits (as vLLM reports them). The engine also refuses ids
            outside the model's vocabulary.
        structured_outputs: a constraint on the output (a JSON schema, any JSON object, a regex,
            a choice, a Lark grammar; :class:`~replica.structured_output.StructuredOutputsParams`
            or a dict of its fields), enforced while decoding. The request ends (``stop``) as
            soon as the constraint is complete, even before ``min_tokens``.
    """

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    MAX_LOGPROBS = 20

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Check every field; raise ``ValueError`` naming the first bad one."""

        def number(name: str, value: Any, *, integer: bool = False) -> None:
            kinds = (int,) if integer else (int, float)
            if isinstance(value, bool) or not isinstance(value, kinds):
                kind = "an integer" if integer else "a number"
                raise ValueError(f"{name} must be {kind}, got {value!r}")
            if not integer and not math.isfinite(value):
                raise ValueError(f"{name} must be finite, got {value!r}")

        number("n", self.n, integer=True)
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        number("max_tokens", self.max_tokens, integer=True)
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be at least 0, got {self.max_tokens}")
        number("min_tokens", self.min_tokens, integer=True)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        number("top_k", self.top_k, integer=True)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k}")
        number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            number(name, value)
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.seed is not None:
            number("seed", self.seed, integer=True)
            # torch.Generator.manual_seed takes 64-bit seeds; sequence i of n uses seed + i.
            if not -(2**63) <= self.seed <= 2**63 - self.n:
                raise ValueError(f"seed must be a 64-bit signed integer (with seed + n - 1 in range), got {self.seed}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {type(self.stop).__name__}")
        for s in self.stop:
            if not isinstance(s, str):
                raise ValueError(f"stop must contain only strings, got {s!r}")
            if s == "":
                raise ValueError("stop must not contain an empty string")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must contain non-negative integers, got {t!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                number(name, value, integer=True)
                if not 0 <= value <= self.MAX_LOGPROBS:
                    raise ValueError(f"{name} must be in [0, {self.MAX_LOGPROBS}], got {value}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id to bias, got {type(self.logit_bias).__name__}")
            if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
                raise ValueError(
                    f"logit_bias holds at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(self.logit_bias)}"
                )
            for token_id, bias in self.logit_bias.items():
                if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                    raise ValueError(f"logit_bias keys must be non-negative integer token ids, got {token_id!r}")
                if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
                    raise ValueError(f"logit_bias values must be finite numbers, got {bias!r} for token {token_id}")
                if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {token_id}")
            self.logit_bias = {token_id: float(bias) for token_id, bias in self.logit_bias.items()}
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as exc:
                raise ValueError(f"structured_outputs: {exc}") from None
        elif self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError(
                    f"structured_outputs must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}"
                )
            self.structured_outputs.validate()


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
