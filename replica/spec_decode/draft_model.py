"""Draft-model drafts: a smaller model with the target's tokenizer proposes each row's next tokens
(its argmax, one forward per draft position), run by the same replica.

The draft has its own :class:`~replica.worker.model_runner.ModelRunner` (weights, paged KV cache
with as many blocks as the target's, persistent batch, compiled graphs and CUDA graphs) and shares
the target's block tables: a request's draft K/V sits in the draft cache under the request's own
block ids, so the scheduler allocates for both at once and frees both at once. The draft keeps,
per request, how many of its tokens have draft K/V (``num_computed`` here); each proposal first
computes the draft K/V of the tokens the target accepted since (for a new or preempted request:
its whole prompt, a chunk like any prefill), then one position per draft. Draft K/V past the
known tokens (the drafts') is recomputed next time, so nothing is rolled back here. Prefix-cached
blocks get their draft K/V from the first request that drafts over them; the draft only ever
writes its own cache, so the target's tokens never depend on it.

Under tensor parallelism the draft runs unsharded on rank 0.
"""

from __future__ import annotations

import time

import torch

from replica.config.engine_config import EngineConfig
from replica.config.model_files import check_draft_model, resolve_model_path
from replica.config.speculative_config import SpeculativeConfig
from replica.core.request import Request
from replica.core.scheduler_output import ScheduledRequest, SchedulerOutput
from replica.sample.sampler import greedy_argmax
from replica.worker.model_runner import ModelRunner

# Weight of the newest measurement in the moving average of a draft position's seconds.
COST_EMA = 0.2


class DraftModelProposer:
    """Drafts from a draft model (see the module docstring).

    Args:
        spec: the speculative config (``model``: the draft).
        config: the engine's config (dtype, device, block size, compile, seats, token budget).
        target: the target's model runner (its block count).
        max_model_len: the engine's.
    Raises:
        ValueError: the draft cannot be found, or its vocabulary or tokenizer differs from the
            target's (:func:`~replica.config.model_files.check_draft_model`); what loading
            a model raises.
    """

    def __init__(self, spec: SpeculativeConfig, config: EngineConfig, target: ModelRunner, max_model_len: int) -> None:
        check_draft_model(config.model, spec.model, config.tokenizer)  # before loading any weights
        path = resolve_model_path(spec.model)
        self.runner = ModelRunner(
            path, dtype=config.dtype, device=config.device, block_size=config.block_size,
            num_blocks=target.num_blocks, kv_cache_memory=None, attention_backend=config.attention_backend,
            compile=config.compile, cuda_graphs=config.cuda_graphs, max_num_seqs=config.max_num_seqs,
        )
        self.runner.init_batch(config.max_num_seqs, max_model_len)
        self.warm_up_report = self.runner.warm_up(config.max_num_batched_tokens, config.max_num_seqs)
        self.max_drafts = spec.num_speculative_tokens
        self._computed: dict[str, int] = {}  # request id -> its tokens with draft K/V
        # A draft position's cost: a decode-sized forward, timed now, then averaged over steps.
        self._seconds_per_position = self.runner.time_forwards([config.max_num_seqs], 1)[0]

    @property
    def seconds_per_position(self) -> float:
        return self._seconds_per_position

    def available(self, request: Request, max_drafts: int) -> int:
        return max_drafts

    @torch.inference_mode()
    def propose(self, rows: list[ScheduledRequest], counts: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in rows]
        for j in range(max(counts)):
            started = time.perf_counter()
            scheduled, which = [], []
            for i, (row, count) in enumerate(zip(rows, counts)):
                if j >= count:
                    continue
                request = row.request
                known = request.num_tokens
                if j == 0:  # the known tokens without draft K/V yet, then the first draft
                    start = min(self._computed.get(request.request_id, 0), known - 1)
                    scheduled.append(ScheduledRequest(request, start, known - start, samples=True))
                else:
                    scheduled.append(ScheduledRequest(
                        request, known + j - 1, 1, samples=True, spec_token_ids=list(drafts[i])
                    ))
                which.append(i)
            _, _, logits = self.runner.launch(SchedulerOutput(step=0, scheduled=scheduled))
            for i, token in zip(which, greedy_argmax(logits[: len(which)]).tolist()):
                drafts[i].append(token)
            if all(s.num_new_tokens <= 2 for s in scheduled):  # a catch-up chunk is not a position's cost
                seconds = time.perf_counter() - started
                self._seconds_per_position = (1 - COST_EMA) * self._seconds_per_position + COST_EMA * seconds
        for row in rows:
            self._computed[row.request.request_id] = row.request.num_tokens
        return drafts

    def forget(self, request_id: str) -> None:
        self._computed.pop(request_id, None)
        self.runner.forget(request_id)
