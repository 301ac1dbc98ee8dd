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

from replica.protocol.constraints import DEAD_END
from replica.protocol.outputs import EngineOutput, FinishReason, TokenLogprobs
from replica.protocol.prefix_hash import ROOT
from replica.protocol.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"




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
    # vLLM's: lower runs first; only the "priority" scheduling policy reads it (replica.core.waiting_queue).
    priority: int = 0
    # The request's latency targets (replica.protocol.slo.LatencyTargets) or None: counted met or
    # missed when it finishes (EngineMetrics.on_slo).
    slo: Any = None
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
    # Static baseline only (replica.core.static_batching): finished, but keeps its seat, blocks and
    # row (a padding row) until its batch ends.
    is_padding: bool = False
    finish_step: int | None = None
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs_sent: bool = False  # handed out in a EngineOutput already
    # Prefix caching: the chained hash of each full block of prompt + output known so far (filled
    # lazily by the scheduler), and how many of the request's blocks are in the prefix cache.
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    # Prompt tokens its first prefix-cache lookup found computed (vLLM's num_cached_tokens; -1: no
    # lookup yet). Reported in each delta; a later lookup (after a preemption) does not change it.
    num_cached_tokens: int = -1
    # Structured output: the constraint's state (replica.sample.grammar.Grammar), or None.
    grammar: Any = None
    # Async scheduling: tokens sampled by a step still in flight, not yet in output_token_ids.
    # num_computed_tokens already counts the positions that step computes (Scheduler.advance).
    num_pending: int = 0
    # LoRA: the request's adapter (replica.lora.adapter.LoRAAdapter), or None for the base model.
    lora: Any = None
    # An embedding request's PoolingParams (replica.protocol.pooling_params), or None; its pooled
    # vector (float32 values) once the step that computes its last prompt token is read.
    pooling_params: Any = None
    embedding: list[float] | None = None

    @property
    def hash_root(self) -> bytes:
        """The parent digest of the request's first block hash: its adapter's, else the base model's."""
        return ROOT if self.lora is None else self.lora.hash_root

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

    def delta(self, token_ids: list[int], text: str, logprobs: list[TokenLogprobs] | None) -> EngineOutput:
        """This request's delta of ``token_ids`` and ``text``, with its finish state and counts now."""
        reason = self.finish_reason
        return EngineOutput(
            request_id=self.request_id,
            new_token_ids=token_ids,
            new_text=text,
            new_logprobs=logprobs,
            finished=self.is_finished,
            finish_reason=reason.value if reason is not None else None,
            stop_reason=self.stop_reason,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens,
            embedding=self.embedding,
            num_cached_tokens=max(self.num_cached_tokens, 0),
        )


def check_stop(request: Request, token_id: int, max_model_len: int) -> tuple[FinishReason | None, int | str | None]:
    """Whether ``request`` ends on ``token_id``, just appended to its output: ``(reason,
    stop_reason)``, or ``(None, None)`` if it goes on. In order: a structured-output constraint
    that refuses the token (``ABORT``, ``DEAD_END``) or is complete (``STOP``); past
    ``min_tokens``, EOS (unless ``ignore_eos``) or a stop token id (``STOP``, with that id);
    ``max_tokens`` or ``max_model_len`` tokens reached (``LENGTH``). It advances the request's
    grammar by the token. Stop strings are the detokenizer's (:mod:`replica.engine.detokenizer`)."""
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








