"""Engine outputs from a step's tokens: per request its incremental detokenizer, stop strings,
latency metrics and prompt logprobs (the part vLLM v1's ``OutputProcessor`` plays).

:class:`~replica.engine.llm_engine.LLMEngine` schedules and runs steps; for each request that
produced a token it asks :meth:`OutputProcessor.token_output` for the request's
:class:`~replica.protocol.outputs.EngineOutput`, and for each request that ended without one
(an abort, an internal error) :meth:`OutputProcessor.final_output`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from replica.core.request import Request
from replica.engine.detokenizer import IncrementalDetokenizer
from replica.engine.metrics import EngineMetrics
from replica.protocol.outputs import EngineOutput, FinishReason, TokenLogprobs

logger = logging.getLogger(__name__)


class OutputProcessor:
    """The detokenizers of the requests under way, and the outputs built from their tokens.

    Args:
        tokenizer: the model's tokenizer.
        metrics: where token and finish latencies go (None: not recorded).
    """

    def __init__(self, tokenizer, metrics: EngineMetrics | None) -> None:
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}

    def detokenizer_for(self, request: Request) -> IncrementalDetokenizer:
        """A new detokenizer for ``request`` (not tracked yet: :meth:`track` once it is queued).
        Raises what the tokenizer raises on the request's prompt."""
        return IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, request.sampling_params, request.eos_token_ids)

    def track(self, request_id: str, detokenizer: IncrementalDetokenizer) -> None:
        self.detokenizers[request_id] = detokenizer

    def token_output(
        self,
        request: Request,
        now: float,
        logprobs: list[TokenLogprobs | None] | None,
        step: int,
        finish_on_stop_string: Callable[[str, str, int], object],
    ) -> EngineOutput:
        """Record the tokens just appended to ``request`` by step ``step`` (one, or with speculative
        decoding one per accepted draft and one more; none for a request that scores its prompt only (``scores_prompt_only``), whose prefill
        just ended it): metrics, detokenizer, stop strings; prompt logprobs with the first.
        ``logprobs``: the new tokens' entries (or None). ``now``: ``time.monotonic()`` seconds.

        The new tokens are those past what the detokenizer has seen, fed one at a time: a stop
        string that a token completes ends the request there, and the tokens after it are dropped
        (they would not exist without speculation). A request still running is ended through
        ``finish_on_stop_string(request_id, stop_string, step)`` (the scheduler's, which frees its
        seat and blocks). Raises what the detokenizer raises."""
        metrics = self.metrics
        first = request.first_token_time is None
        scored_only = request.sampling_params.scores_prompt_only
        detokenizer = self.detokenizers[request.request_id]
        token_ids = [] if scored_only else request.output_token_ids[detokenizer.num_tokens :]
        if first:
            request.first_token_time = now
            if metrics is not None:
                metrics.on_prompt_prefilled(request.num_prompt_tokens)
        previous = request.arrival_time if first else request.last_token_time
        request.last_token_time = now
        text = []
        for k, token in enumerate(token_ids):
            last = k == len(token_ids) - 1
            update = detokenizer.update([token], finished=request.is_finished and last)
            text.append(update.delta_text)
            if update.stop_string is not None:
                token_ids = token_ids[: k + 1]
                self._stop_at(request, detokenizer, update.stop_string, step, finish_on_stop_string)
                break
        if metrics is not None and token_ids:  # the tokens emitted (not those a stop string dropped)
            # The step's tokens arrive together: the wait is shared out over them (vLLM's ITL is
            # per step; per token, its sum still equals the request's decode time).
            since = (now - previous) / len(token_ids)
            for k in range(len(token_ids)):
                metrics.on_token(first=first and k == 0, since_previous_s=since, priority=request.priority)
        if request.is_finished:
            self._finished(request, now)
        if logprobs is not None:
            logprobs = logprobs[: len(token_ids)]
        output = request.delta(token_ids, "".join(text), logprobs if logprobs and any(logprobs) else None)
        if request.sampling_params.prompt_logprobs is not None and not request.prompt_logprobs_sent:
            request.prompt_logprobs_sent = True
            output.prompt_logprobs = [None, *request.prompt_logprobs]
        return output

    @staticmethod
    def _stop_at(request: Request, detokenizer, stop_string: str, step: int, finish_on_stop_string) -> None:
        """A stop string ended the request at the detokenizer's last token: drop later tokens
        (speculative decoding's), then end it (a request the scheduler already ended, on a later
        token's stop or length, gets the stop string as its reason)."""
        del request.output_token_ids[detokenizer.num_tokens :]
        if request.is_finished:
            request.finish_reason, request.stop_reason = FinishReason.STOP, stop_string
        else:
            finish_on_stop_string(request.request_id, stop_string, step)

    def final_output(self, request: Request, error: BaseException | None = None) -> EngineOutput:
        """The last output of ``request``, which the scheduler has just ended without a token (an
        abort; with ``error``, an internal error, reported in the output's ``error``)."""
        self._finished(request, time.monotonic())
        output = request.delta([], "", None)
        if error is not None:
            output.error = f"internal error while generating: {type(error).__name__}: {error}"
        return output

    def _finished(self, request: Request, now: float) -> None:
        request.finished_time = now
        self.detokenizers.pop(request.request_id, None)
        if self.metrics is not None:
            self.metrics.on_finished(request.finish_reason.value, now - request.arrival_time)
            if request.embedding is not None:
                self.metrics.on_embedding(request.num_prompt_tokens, now - request.arrival_time)
            if request.slo is not None and request.finish_reason is not FinishReason.ABORT:
                self.metrics.on_slo("met" if slo_met(request, now) else "missed")


def slo_met(request: Request, now: float) -> bool:
    """Whether ``request``, finished at ``now``, met its latency targets (``request.slo``): TTFT
    from its arrival at this engine to its first token; TPOT the mean gap after the first token
    (``(now - first token) / (output tokens - 1)``); a request that scored its prompt only has
    its TTFT at its end."""
    first = request.first_token_time if request.first_token_time is not None else now
    n = request.num_output_tokens
    tpot = (now - first) / (n - 1) if n > 1 else None
    return request.slo.met(first - request.arrival_time, tpot)
