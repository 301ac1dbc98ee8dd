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
        lp: TokenLogprobs | None,
        step: int,
        finish_on_stop_string: Callable[[str, str, int], object],
    ) -> EngineOutput:
        """Record the token just appended to ``request`` (none with ``max_tokens == 0``, whose
        prefill just ended it) by step ``step``: metrics, detokenizer, stop strings; prompt logprobs
        with the first. ``now``: ``time.monotonic()`` seconds. A stop string found in a request
        still running ends it through ``finish_on_stop_string(request_id, stop_string, step)``
        (the scheduler's, which frees its seat and blocks). Raises what the detokenizer raises."""
        metrics = self.metrics
        first = request.first_token_time is None
        scored_only = request.sampling_params.max_tokens == 0
        if first:
            request.first_token_time = now
        if metrics is not None:
            if first:
                metrics.on_prompt_prefilled(request.num_prompt_tokens)
            if not scored_only:
                since = now - (request.arrival_time if first else request.last_token_time)
                metrics.on_token(first=first, since_previous_s=since)
        request.last_token_time = now
        token_ids, text = [], ""
        if not scored_only:
            token_ids = [request.output_token_ids[-1]]
            update = self.detokenizers[request.request_id].update(token_ids, finished=request.is_finished)
            text = update.delta_text
            if update.stop_string is not None:
                if request.is_finished:
                    request.finish_reason, request.stop_reason = FinishReason.STOP, update.stop_string
                else:
                    finish_on_stop_string(request.request_id, update.stop_string, step)
        if request.is_finished:
            self._finished(request, now)
        output = request.delta(token_ids, text, [lp] if lp else None)
        if request.sampling_params.prompt_logprobs is not None and not request.prompt_logprobs_sent:
            request.prompt_logprobs_sent = True
            output.prompt_logprobs = [None, *request.prompt_logprobs]
        return output

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
