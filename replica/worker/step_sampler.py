"""Sampling one step's logits: the next token of every row that reaches its last known token, the
prompt logprobs asked for, and the embeddings of the embedding requests whose prompt ends
(:class:`StepSampler`, the model runner's; rank 0 only under tensor parallelism).

The sampler's inputs come from the persistent batch's seats (:class:`~replica.worker.sampling_batch.SamplingBatch`,
gathered into a :class:`~replica.sample.metadata.SamplingMetadata` per step); the scheduler's
requests are read here only for which rows still run and for prompt logprobs. A row whose seat
holds an error (settings that could not be written) fails alone, as does a row that breaks the
batched sampler (it is then sampled row by row).
"""

from __future__ import annotations

import logging

import torch
from torch.profiler import record_function

from replica.core.request import RequestStatus
from replica.core.scheduler_output import SchedulerOutput
from replica.sample.logprobs import token_logprobs
from replica.sample.rejection_sampler import verify
from replica.sample.sampler import Sampler
from replica.worker.input_batch import ModelInputs
from replica.worker.pooler import pool
from replica.worker.sampling_batch import SamplingBatch
from replica.worker.model_runner_output import ModelRunnerOutput, PendingTokens

logger = logging.getLogger(__name__)


class StepSampler:
    """Samples the logits ``[num_logits_rows, vocab]`` of a step on ``device`` (sampling rows
    first, then prompt rows, then step padding; see :class:`~replica.worker.input_batch.ModelInputs`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sampler = Sampler()
        self.seats: SamplingBatch | None = None  # the persistent batch's (ModelRunner.init_batch)

    @torch.inference_mode()
    def sample_later(self, launched: tuple[SchedulerOutput, ModelInputs, torch.Tensor]) -> PendingTokens:
        """Sample a launched step (:meth:`launch`) without reading its tokens back: the rows of
        requests still running (a request that ended since it was scheduled gets no token). A step
        with logprobs, prompt logprobs or a sampling error is sampled as :meth:`execute` does."""
        out, inputs, logits = launched
        keep = [k for k, row in enumerate(inputs.sample_rows) if out.scheduled[row].request.status == RequestStatus.RUNNING]
        rows_of = [inputs.sample_rows[k] for k in keep]
        seats = inputs.sample_seats if len(keep) == len(inputs.sample_rows) else inputs.seats[rows_of]
        metadata = self.seats.gather(seats)
        plain = (
            not inputs.prompt_spans
            and not inputs.pool_rows
            and not inputs.draft_spans
            and not metadata.any_logprobs
            and not any(s.is_padding for s in out.scheduled)  # static baseline's padding rows: _sample
            and not (self.seats.num_errors and any(self.seats.error_of(seat) for seat in seats.tolist()))
        )
        if plain:
            rows = logits[: len(inputs.sample_rows)]
            if len(keep) < len(inputs.sample_rows):
                rows = rows.index_select(0, torch.tensor(keep, dtype=torch.int64, device=logits.device))
            try:
                with record_function("carpool.sample"):
                    tokens = self.sampler.sample_ids(rows, metadata) if keep else rows.new_empty(0, dtype=torch.int64)
            except Exception:
                logger.exception("batched sampling failed; sampling the step's rows one by one")
            else:
                ids = [out.scheduled[row].request.request_id for row in rows_of]
                return PendingTokens(ids, rows_of, tokens, len(out.scheduled))
        result = self.sample(out, inputs, logits)
        ids = [None if s.is_padding else s.request.request_id for s in out.scheduled]  # static padding: no next step
        return PendingTokens.done(result, ids, self.device)

    def _failed_seats(self, rows: list[int], inputs: ModelInputs, result: ModelRunnerOutput) -> list[int]:
        """``rows`` (scheduled rows) less those whose seat holds an error, which goes to ``result``."""
        if not self.seats.num_errors:
            return rows
        kept = []
        for row in rows:
            error = self.seats.error_of(int(inputs.seats[row]))
            if error is None:
                kept.append(row)
            else:
                result.errors[row] = error
        return kept

    @torch.inference_mode()
    def sample(self, out: SchedulerOutput, inputs, logits: torch.Tensor) -> ModelRunnerOutput:
        """Sample the step's sampling rows and score its prompt rows from ``logits``
        ``[num_logits_rows, vocab]`` (sampling rows first, then prompt rows, then step padding)."""
        sample_rows = inputs.sample_rows
        num_real_rows = len(sample_rows)
        result = ModelRunnerOutput([None] * len(out.scheduled), [None] * len(out.scheduled))
        if inputs.prompt_spans:
            first = num_real_rows + inputs.num_draft_rows
            with record_function("carpool.prompt_logprobs"):
                self._score_prompts(out, inputs, logits[first : first + inputs.num_prompt_rows], result)
        if inputs.pool_rows:
            self._pool(out, inputs, result)
        verified = set()
        if inputs.draft_spans:
            with record_function("carpool.verify_drafts"):
                verified = self._verify(out, inputs, logits, result)
        logits = logits[:num_real_rows]  # [num_sampling_rows, vocab]
        if not sample_rows:
            return result

        # Rows of running requests (async scheduling: one that ended since it was scheduled gets
        # none), less those whose drafts were verified.
        real = [
            i for i, row in enumerate(sample_rows)
            if out.scheduled[row].request.status == RequestStatus.RUNNING and row not in verified
        ]
        if self.seats.num_errors:  # rows whose seat holds an error fail alone
            kept = set(self._failed_seats([sample_rows[i] for i in real], inputs, result))
            real = [i for i in real if sample_rows[i] in kept]
        static_padding = [i for i, row in enumerate(sample_rows) if out.scheduled[row].is_padding]
        if real:
            metadata = self.seats.gather(inputs.seats[[sample_rows[i] for i in real]])
            real_logits = logits if len(real) == len(sample_rows) else logits[real]
            try:
                with record_function("carpool.sample"):
                    sampled = self.sampler(real_logits, metadata)
            except Exception:
                # One request's parameters or state may break the batched sampler: sample each
                # row alone, so that only the rows that fail by themselves fail.
                logger.exception("batched sampling failed; sampling the %d rows one by one", len(real))
                for k, i in enumerate(real):
                    row = sample_rows[i]
                    try:
                        one = self.sampler(real_logits[k : k + 1], metadata.select([k]))
                    except Exception as exc:
                        result.errors[row] = exc
                        continue
                    result.sampled_token_ids[row] = one.token_ids[0]
                    result.logprobs[row] = one.logprobs[0]
            else:
                for i, token_id, lp in zip(real, sampled.token_ids, sampled.logprobs):
                    result.sampled_token_ids[sample_rows[i]] = token_id
                    result.logprobs[sample_rows[i]] = lp
        if static_padding:
            # Static baseline: finished members' rows, computed as in a padded batch; tokens thrown away.
            for i, token_id in zip(static_padding, logits[static_padding].argmax(dim=-1).tolist()):
                result.sampled_token_ids[sample_rows[i]] = token_id
        return result

    def _verify(self, out: SchedulerOutput, inputs, logits: torch.Tensor, result: ModelRunnerOutput) -> set[int]:
        """Verify the drafts of ``inputs.draft_spans`` (:func:`~replica.sample.rejection_sampler.verify`)
        into ``result``; returns their scheduled rows. A failure ends only the requests of those rows."""
        num_sampling = len(inputs.sample_rows)
        sampling_row = {row: k for k, row in enumerate(inputs.sample_rows)}
        blocks, drafts, rows = [], [], []
        offset = num_sampling
        spans = inputs.draft_spans
        ok = set(self._failed_seats([i for i, _ in spans], inputs, result))
        for i, k in spans:
            offset += k
            if i not in ok:
                continue
            index = torch.tensor([*range(offset - k, offset), sampling_row[i]], device=logits.device)
            blocks.append(logits.index_select(0, index))
            drafts.append(out.scheduled[i].spec_token_ids)
            rows.append(i)
        if not rows:
            return {i for i, _ in spans}
        metadata = self.seats.gather(inputs.seats[rows])
        try:
            verified = verify(self.sampler, blocks, metadata, drafts)
        except Exception:
            # One request's parameters or state may break the batch: verify each row alone, so
            # that only the rows that fail by themselves fail.
            logger.exception("verifying drafts failed; verifying the %d rows one by one", len(rows))
            verified = []
            for k, (i, block, draft) in enumerate(zip(rows, blocks, drafts)):
                try:
                    verified += verify(self.sampler, [block], metadata.select([k]), [draft])
                except Exception as exc:
                    result.errors[i] = exc
                    verified.append(None)
        for i, one in zip(rows, verified):
            if one is not None:
                tokens, logprobs = one
                result.sampled_token_ids[i], result.logprobs[i] = tokens[0], logprobs[0]
                result.extra_token_ids[i], result.extra_logprobs[i] = tokens[1:], logprobs[1:]
        return {i for i, _ in spans}

    def _pool(self, out: SchedulerOutput, inputs, result: ModelRunnerOutput) -> None:
        """The embeddings of ``inputs.pool_rows`` from the output layer's input rows (after the
        sampling, draft and prompt rows) into ``result.embeddings``; a failure ends only those requests."""
        first = len(inputs.sample_rows) + inputs.num_draft_rows + inputs.num_prompt_rows
        rows = inputs.pool_rows
        try:
            with record_function("carpool.pool"):
                vectors = pool(inputs.head_input[first : first + len(rows)],
                               [out.scheduled[i].request.pooling_params for i in rows])
        except Exception as exc:
            logger.exception("pooling failed for %d rows", len(rows))
            for i in rows:
                result.errors[i] = exc
            return
        result.embeddings.update(zip(rows, vectors))

    def _score_prompts(self, out: SchedulerOutput, inputs, logits: torch.Tensor, result: ModelRunnerOutput) -> None:
        """Prompt logprobs of ``inputs.prompt_spans`` from their logits rows ``[num_prompt_rows, V]``
        into ``result.prompt_logprobs``; a failure ends only the requests of those rows."""
        targets: list[int] = []
        ks: list[int] = []
        for i, first, end in inputs.prompt_spans:
            request = out.scheduled[i].request
            targets.extend(request.prompt_token_ids[first + 1 : end + 1])  # position q scores token q + 1
            ks.extend([request.sampling_params.prompt_logprobs] * (end - first))
        try:
            entries = token_logprobs(logits, torch.tensor(targets, device=logits.device), ks)
        except Exception as exc:
            logger.exception("prompt logprobs failed for %d rows", len(targets))
            for i, _, _ in inputs.prompt_spans:
                result.errors[i] = exc
            return
        offset = 0
        for i, first, end in inputs.prompt_spans:
            result.prompt_logprobs[i] = entries[offset : offset + end - first]
            offset += end - first
