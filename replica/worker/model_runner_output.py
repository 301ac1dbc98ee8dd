"""What a step's sampling hands the engine: :class:`ModelRunnerOutput`, now or later (:class:`PendingTokens`).

Plain data plus one device-to-host copy; :mod:`replica.worker.model_runner` builds both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from replica.core.scheduler_output import SchedulerOutput
from replica.protocol.outputs import TokenLogprobs


@dataclass
class ModelRunnerOutput:
    """Per scheduled row of a step: the sampled token (None if the row does not sample) and logprobs.

    ``errors`` maps a row to the exception that sampling that row alone raised (its token is None).
    ``prompt_logprobs`` maps a row to the prompt logprobs its chunk computed, in position order.
    ``extra_token_ids`` (speculative decoding) maps a row that verified drafts to the tokens it
    emits after its first (one per accepted draft), ``extra_logprobs`` to their logprobs entries.
    ``embeddings`` maps the row of an embedding request that computed its last prompt token to its
    pooled vector (:mod:`replica.worker.pooler`).
    """

    sampled_token_ids: list[int | None]
    logprobs: list[TokenLogprobs | None]
    errors: dict[int, Exception] = field(default_factory=dict)
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    extra_token_ids: dict[int, list[int]] = field(default_factory=dict)
    extra_logprobs: dict[int, list[TokenLogprobs | None]] = field(default_factory=dict)
    embeddings: dict[int, list[float]] = field(default_factory=dict)


class PendingTokens:
    """A step's sampled tokens, kept on the device until :meth:`result` (async scheduling).

    Either ``tokens`` ``[k]`` (int64, on the logits' device) sampled for the scheduled ``rows``
    ``[k]`` of a step of ``num_rows`` rows, with no logprobs: on CUDA the copy to pinned host memory
    starts at once and :meth:`result` waits for it alone. Or an already finished ``result``
    (a step with logprobs, prompt logprobs, embeddings, padding or a sampling error), whose tokens are put on
    ``device`` for the next step's inputs.

    :meth:`index` maps a request id to its token's position in :attr:`tokens`: the next step's
    decode rows read their input token from there (``ScheduledRequest.from_previous``), so the
    host never waits for a token before the next forward is launched.
    """

    def __init__(
        self,
        request_ids: list[str],
        rows: list[int],
        tokens: torch.Tensor,
        num_rows: int,
        result: ModelRunnerOutput | None = None,
    ) -> None:
        self.tokens = tokens
        self._index = {request_id: k for k, request_id in enumerate(request_ids)}
        self._rows = rows
        self._num_rows = num_rows
        self._result = result
        self._host = tokens
        self._copied = None
        if result is None and tokens.device.type == "cuda":
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    @classmethod
    def done(cls, result: ModelRunnerOutput, request_ids: list[str | None], device: torch.device) -> "PendingTokens":
        """Wrap a finished ``result``; ``request_ids[i]`` names row ``i``'s request (None: no token)."""
        rows = [i for i, (rid, t) in enumerate(zip(request_ids, result.sampled_token_ids)) if rid and t is not None]
        tokens = torch.tensor([result.sampled_token_ids[i] for i in rows], dtype=torch.int64, device=device)
        return cls([request_ids[i] for i in rows], rows, tokens, len(request_ids), result)

    def index(self, request_id: str) -> int | None:
        """Position of ``request_id``'s token in :attr:`tokens`, or None if it has none."""
        return self._index.get(request_id)

    def result(self) -> ModelRunnerOutput:
        """The step's :class:`ModelRunnerOutput` (waits for the device-to-host copy of the tokens)."""
        if self._result is None:
            if self._copied is not None:
                self._copied.synchronize()
            sampled: list[int | None] = [None] * self._num_rows
            for row, token in zip(self._rows, self._host.tolist()):
                sampled[row] = token
            self._result = ModelRunnerOutput(sampled, [None] * self._num_rows)
        return self._result

    def inputs_for(
        self, scheduled: list, query_start: np.ndarray, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(token indices [k], token ids [k])`` on ``device``: the input tokens of the next step's
        ``from_previous`` rows (``scheduled``: its ``ScheduledRequest`` rows; ``query_start``: each
        row's first token index), or None if none has a token here. A row whose request got no
        token (its sampling failed) keeps a stale id: that request ends when this step is read,
        before the row's own token would be."""
        found = [
            (int(query_start[i]), self.index(s.request.request_id)) for i, s in enumerate(scheduled) if s.from_previous
        ]
        found = [(dst, src) for dst, src in found if src is not None]
        if not found:
            return None
        dst = torch.tensor([d for d, _ in found], dtype=torch.int64).to(device, non_blocking=True)
        src = torch.tensor([s for _, s in found], dtype=torch.int64).to(self.tokens.device, non_blocking=True)
        return dst, self.tokens.index_select(0, src)


class InFlight(NamedTuple):
    """Async scheduling: a step whose forward and sampling are launched, its tokens not read yet."""

    out: SchedulerOutput
    tokens: PendingTokens
