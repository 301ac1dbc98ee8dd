"""The persistent batch: every running request's token ids and block table in preallocated host
arrays, updated in place for what changed, from which a step's flat inputs are gathered.

The idea of vLLM v1's ``InputBatch``: a request gets a row when it is first scheduled and keeps it
until it finishes or is preempted (the engine calls :meth:`InputBatch.forget`). Each step writes
only its new tokens (a decode: one) and its new blocks into the row; the step's ``input_ids``,
``positions`` and ``slot_mapping`` are then a handful of numpy gathers over all its tokens, not a
Python loop per token. This module builds host numpy arrays and no tensor (torch comes in only
through :mod:`replica.attention.backend`, which it imports for :class:`AttentionMetadata`): the
model runner turns the arrays into tensors with one host-to-device copy
(:func:`replica.attention.backend.to_device`).

Each row (a *seat*) also holds its request's sampling inputs (:mod:`replica.worker.sampling_batch`),
written when the request takes the row and cleared when it leaves, from which the step sampler
gathers the sampler's :class:`~replica.sample.metadata.SamplingMetadata`.

The static baseline's padding rows (``ScheduledRequest.is_padding``, :mod:`replica.core.static_batching`)
are the one special case: such a row recomputes its request's last token at the next position.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from replica.attention.backend import AttentionMetadata
from replica.kernels.shapes import padded_size
from replica.worker.sampling_batch import SamplingBatch


@dataclass
class ModelInputs:
    """One step's flat inputs (host arrays; ``T`` = tokens after step padding).

    ``input_ids``, ``positions``: ``[T]``; ``logits_indices``: ``[R]``, the packed token whose
    logits each logits row takes: first one per sampling row, then one per prompt position whose
    prompt logprob is asked for, then padding to a bucket when the step is padded;
    ``sample_rows``: ``[num_sampling_rows]``, the index into the scheduled rows of each sampling row;
    ``prompt_spans``: ``(scheduled row, first position, end position)`` of the prompt positions
    whose logits rows follow the sampling rows, in order (position ``q`` scores prompt token
    ``q + 1``).
    ``draft_spans`` (speculative decoding): ``(scheduled row, k)`` of each row that verifies ``k``
    drafts; its ``k`` draft logits rows (the logits of its chunk's first ``k`` tokens, which score
    the drafts) follow the sampling rows, before the prompt rows, in order.
    ``sequences`` is what the attention backend plans from. ``seats``: ``[num_scheduled]`` int64,
    each scheduled row's seat in the persistent batch (its sampling inputs: ``InputBatch.sampling``);
    ``sample_seats``: ``[num_sampling_rows]``, the sampling rows' seats (``seats[sample_rows]``).
    ``pool_rows`` (embedding requests): the scheduled rows whose chunk computes their request's
    last prompt token; one logits row each, after the prompt rows, whose hidden state the runner
    pools (:mod:`replica.worker.pooler`) instead of sampling.
    """

    input_ids: np.ndarray
    positions: np.ndarray
    logits_indices: np.ndarray
    sample_rows: list[int]
    sequences: AttentionMetadata
    prompt_spans: list[tuple[int, int, int]]
    draft_spans: list[tuple[int, int]] = field(default_factory=list)
    seats: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    sample_seats: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    pool_rows: list[int] = field(default_factory=list)
    head_input: Any = None  # after the forward, with pool_rows: the output layer's input [num_logits_rows, hidden]

    @property
    def num_draft_rows(self) -> int:
        """Logits rows that score drafts (after the sampling rows, before the prompt rows)."""
        return sum(k for _, k in self.draft_spans)

    @property
    def num_prompt_rows(self) -> int:
        """Logits rows of prompt positions (after the sampling rows)."""
        return sum(end - first for _, first, end in self.prompt_spans)


class InputBatch:
    """Rows of token ids and block tables for up to ``max_rows`` running requests.

    Args:
        max_rows: seats (``max_num_seqs``).
        max_model_len: tokens per request at most (the row length).
        block_size: tokens per KV block.
        padding_slot: the KV slot that padding tokens write to (held by no block table).
        device: where seeded requests' generators draw (:class:`SamplingBatch`).
    """

    def __init__(
        self, max_rows: int, max_model_len: int, block_size: int, padding_slot: int, device: str = "cpu"
    ) -> None:
        self.block_size = block_size
        self.padding_slot = padding_slot
        max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_rows, max_model_len), dtype=np.int64)
        self.block_table = np.zeros((max_rows, max_blocks), dtype=np.int64)
        self._num_tokens = [0] * max_rows  # tokens written per row
        self._num_blocks = [0] * max_rows  # block ids written per row
        self._row_of: dict[str, int] = {}
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self.sampling = SamplingBatch(max_rows, device)

    @property
    def num_rows_used(self) -> int:
        return len(self._row_of)

    def forget(self, request_id: str) -> None:
        """The request finished or was preempted: its row is free (a preempted request gets a new
        row, rewritten whole, when it is scheduled again)."""
        row = self._row_of.pop(request_id, None)
        if row is not None:
            self._free_rows.append(row)
            self.sampling.remove(row)
        else:
            self.sampling.discard(request_id)

    def _sync(self, request) -> int:
        """The request's row, with its tokens and blocks written up to now (O(what changed))."""
        row = self._row_of.get(request.request_id)
        if row is None:
            if not self._free_rows:
                raise RuntimeError(f"input batch full ({len(self._row_of)} rows): a finished request was not forgotten")
            row = self._free_rows.pop()
            self._row_of[request.request_id] = row
            self._num_tokens[row] = self._num_blocks[row] = 0
            self.sampling.add(row, request)
        have, total = self._num_tokens[row], request.num_tokens
        if have < total:
            prompt = request.prompt_token_ids
            if have < len(prompt):
                self.token_ids[row, have : len(prompt)] = prompt[have:]
                have = len(prompt)
            if have < total:
                self.token_ids[row, have:total] = request.output_token_ids[have - len(prompt) :]
            self._num_tokens[row] = total
        blocks = request.block_ids
        have = min(self._num_blocks[row], len(blocks))
        if have < len(blocks):
            self.block_table[row, have : len(blocks)] = blocks[have:]
        # Blocks past the known tokens may hold drafts, which are given back and replaced by other
        # blocks (speculative decoding): they are written again at the next sync.
        self._num_blocks[row] = min(len(blocks), -(-total // self.block_size))
        return row

    def prepare(self, scheduled, *, pad: bool, min_tokens: int = 1, min_rows: int = 1) -> ModelInputs:
        """Flat inputs of one step from the scheduler's rows (``ScheduledRequest``s).

        With ``pad``, the token count and the logits rows are padded to :func:`padded_size`;
        the token count is also padded up to ``min_tokens``, and both up to ``min_rows`` (logits
        rows only when there are any; see ``ModelRunner.min_rows``). Padding tokens have id 0,
        position 0 and write their K/V to ``padding_slot``; padding logits rows repeat the last.
        (Step padding, unrelated to the static baseline's padding rows: see the module docstring.)
        """
        num_seqs = len(scheduled)
        rows = np.empty(num_seqs, dtype=np.int64)
        starts = np.empty(num_seqs, dtype=np.int64)
        counts = np.empty(num_seqs, dtype=np.int64)
        samples = np.zeros(num_seqs, dtype=bool)
        static_padding_rows = []  # static baseline: finished members' rows
        prompt_spans = []
        draft_spans = []
        pool_rows = []  # embedding requests whose chunk ends their prompt
        for i, sched in enumerate(scheduled):
            request = sched.request
            rows[i] = self._sync(request)
            starts[i] = sched.start
            counts[i] = sched.num_new_tokens
            samples[i] = sched.samples
            if sched.spec_token_ids:  # drafts past the known tokens: written where they would go
                known = request.num_tokens
                self.token_ids[rows[i], known : known + len(sched.spec_token_ids)] = sched.spec_token_ids
                if sched.num_verified_drafts:
                    draft_spans.append((i, sched.num_verified_drafts))
            if (request.pooling_params is not None and not sched.is_padding
                    and sched.start + sched.num_new_tokens == request.num_prompt_tokens):
                pool_rows.append(i)
            if sched.is_padding:
                static_padding_rows.append(i)
            elif request.sampling_params.prompt_logprobs is not None:
                # Positions not scored yet (a recompute after preemption scores nothing twice).
                first = max(sched.start, len(request.prompt_logprobs))
                end = min(sched.start + sched.num_new_tokens, request.num_prompt_tokens - 1)
                if end > first:
                    prompt_spans.append((i, first, end))
        query_start = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start[1:])
        num_real = int(query_start[-1])
        seq_of_token = np.repeat(np.arange(num_seqs), counts)
        positions = np.arange(num_real) - query_start[seq_of_token] + starts[seq_of_token]
        token_rows = rows[seq_of_token]
        input_ids = self.token_ids[token_rows, positions]
        for i in static_padding_rows:  # static baseline: a finished member recomputes its last token
            input_ids[query_start[i]] = self.token_ids[rows[i], self._num_tokens[rows[i]] - 1]
        bs = self.block_size
        slots = self.block_table[token_rows, positions // bs] * bs + positions % bs
        seq_lens = starts + counts
        width = int(-(-seq_lens.max() // bs))
        logits_indices = query_start[1:][samples] - 1
        if prompt_spans or draft_spans or pool_rows:
            logits_indices = np.concatenate([
                logits_indices,
                *(query_start[i] + np.arange(k) for i, k in draft_spans),
                *(np.arange(first, end) - starts[i] + query_start[i] for i, first, end in prompt_spans),
                query_start[1:][pool_rows] - 1,
            ])
        sample_rows = np.flatnonzero(samples).tolist()
        num_tokens = max(padded_size(num_real) if pad else num_real, min_tokens, min_rows)
        if num_tokens > num_real:
            extra = num_tokens - num_real
            input_ids = np.concatenate([input_ids, np.zeros(extra, dtype=np.int64)])
            positions = np.concatenate([positions, np.zeros(extra, dtype=np.int64)])
            slots = np.concatenate([slots, np.full(extra, self.padding_slot, dtype=np.int64)])
        n = len(logits_indices)
        if n and (pad or n < min_rows):  # also when the token count already is a bucket
            target = max(padded_size(n) if pad else n, min_rows)
            logits_indices = np.concatenate([logits_indices, np.full(target - n, logits_indices[-1])])
        sequences = AttentionMetadata(
            query_start=query_start,
            query_lens=counts,
            context_lens=starts,
            seq_lens=seq_lens,
            block_tables=self.block_table[rows, :width],
            slot_mapping=slots,
            num_tokens=num_tokens,
        )
        return ModelInputs(
            input_ids, positions, logits_indices, sample_rows, sequences, prompt_spans, draft_spans, rows, rows[samples],
            pool_rows,
        )



def decode_arrays(seqs: AttentionMetadata, *, min_columns: int, spare_block: int) -> list[np.ndarray]:
    """A decode-like step's attention inputs (:class:`~replica.attention.backend.DecodeStep`), one
    query per token: a prefill chunk's token ``j`` becomes a query of its sequence's block table
    that sees the sequence's first ``context_len + j + 1`` tokens (causal attention, one query at a
    time), and padding tokens one-token sequences on ``spare_block``. Returns ``[slot_mapping [T],
    block tables [T, max(width, min_columns)], seq_lens [T]]`` (``T`` = the step's tokens)."""
    num_real = int(seqs.query_lens.sum())
    extra = seqs.num_tokens - num_real
    tables, lens = seqs.block_tables, seqs.seq_lens
    if num_real != seqs.num_seqs:  # prefill chunks: one row per token, in token order
        _, rows, lens = seqs.decode_queries(np.arange(seqs.num_seqs))
        tables = tables[rows]
    if tables.shape[1] < min_columns:
        tables = np.concatenate([tables, np.full((len(tables), 1), spare_block, dtype=tables.dtype)], axis=1)
    if extra:
        pad_tables = np.full((extra, tables.shape[1]), spare_block, dtype=tables.dtype)
        tables = np.concatenate([tables, pad_tables])
        lens = np.concatenate([lens, np.ones(extra, dtype=lens.dtype)])
    return [seqs.slot_mapping, tables, lens]
