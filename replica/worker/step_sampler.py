"""Sampling one step's logits: the next token of every row that reaches its last known token, and the
prompt logprobs asked for (:class:`StepSampler`, the model runner's; rank 0 only under tensor
parallelism)."""

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
from replica.worker.model_runner_output import ModelRunnerOutput, PendingTokens

logger = logging.getLogger(__name__)


class StepSampler:
    """Samples the logits ``[num_logits_rows, vocab]`` of a step on ``device`` (sampling rows
    first, then prompt rows, then step padding; see :class:`~replica.worker.input_batch.ModelInputs`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sampler = Sampler()

    @torch.inference_mode()
    def sample_later(self, launched: tuple[SchedulerOutput, ModelInputs, torch.Tensor]) -> PendingTokens:
        """Sample a launched step (:meth:`launch`) without reading its tokens back: the rows of
        requests still running (a request that ended since it was scheduled gets no token). A step
        with logprobs, prompt logprobs or a sampling error is sampled as :meth:`execute` does."""
        out, inputs, logits = launched
        keep = [k for k, row in enumerate(inputs.sample_rows) if out.scheduled[row].request.status == RequestStatus.RUNNING]
        requests = [out.scheduled[inputs.sample_rows[k]].request for k in keep]
        plain = (
            not inputs.prompt_spans
            and not inputs.draft_spans
            and all(r.sampling_params.logprobs is None for r in requests)
            and not any(s.is_padding for s in out.scheduled)  # static baseline's padding rows: _sample
        )
        if plain:
            self._seed_generators(requests)
            rows = logits[: len(inputs.sample_rows)]
            if len(keep) < len(inputs.sample_rows):
                rows = rows.index_select(0, torch.tensor(keep, dtype=torch.int64, device=logits.device))
            try:
                with record_function("carpool.sample"):
                    tokens = self.sampler.sample_ids(rows, requests) if requests else rows.new_empty(0, dtype=torch.int64)
            except Exception:
                logger.exception("batched sampling failed; sampling the step's rows one by one")
            else:
                rows_of = [inputs.sample_rows[k] for k in keep]
                return PendingTokens([r.request_id for r in requests], rows_of, tokens, len(out.scheduled))
        result = self.sample(out, inputs, logits)
        ids = [None if s.is_padding else s.request.request_id for s in out.scheduled]  # static padding: no next step
        return PendingTokens.done(result, ids, self.device)

    def _seed_generators(self, requests) -> None:
        for request in requests:
            if request.sampling_params.seed is not None and request.generator is None:
                request.generator = torch.Generator(device=self.device).manual_seed(request.sampling_params.seed)

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
        static_padding = [i for i, row in enumerate(sample_rows) if out.scheduled[row].is_padding]
        if real:
            requests = [out.scheduled[sample_rows[i]].request for i in real]
            self._seed_generators(requests)
            real_logits = logits if len(real) == len(sample_rows) else logits[real]
            try:
                with record_function("carpool.sample"):
                    sampled = self.sampler(real_logits, requests)
            except Exception:
                # One request's parameters or state may break the batched sampler: sample each
                # row alone, so that only the rows that fail by themselves fail.
                logger.exception("batched sampling failed; sampling the %d rows one by one", len(real))
                for k, (i, request) in enumerate(zip(real, requests)):
                    row = sample_rows[i]
                    try:
                        one = self.sampler(real_logits[k : k + 1], [request])
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
        blocks, requests, drafts, rows = [], [], [], []
        offset = num_sampling
        for i, k in inputs.draft_spans:
            index = torch.tensor([*range(offset, offset + k), sampling_row[i]], device=logits.device)
            offset += k
            blocks.append(logits.index_select(0, index))
            requests.append(out.scheduled[i].request)
            drafts.append(out.scheduled[i].spec_token_ids)
            rows.append(i)
        self._seed_generators(requests)
        try:
            verified = verify(self.sampler, blocks, requests, drafts)
        except Exception:
            # One request's parameters or state may break the batch: verify each row alone, so
            # that only the rows that fail by themselves fail.
            logger.exception("verifying drafts failed; verifying the %d rows one by one", len(rows))
            verified = []
            for i, block, request, draft in zip(rows, blocks, requests, drafts):
                try:
                    verified += verify(self.sampler, [block], [request], [draft])
                except Exception as exc:
                    result.errors[i] = exc
                    verified.append(None)
        for i, one in zip(rows, verified):
            if one is not None:
                tokens, logprobs = one
                result.sampled_token_ids[i], result.logprobs[i] = tokens[0], logprobs[0]
                result.extra_token_ids[i], result.extra_logprobs[i] = tokens[1:], logprobs[1:]
        return set(rows)

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
