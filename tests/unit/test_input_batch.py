"""The persistent batch builds a step's flat inputs from the scheduler's rows: token ids, positions
and KV slots of every scheduled token, rows kept across steps and freed when forgotten."""

from __future__ import annotations

import numpy as np
import torch

from replica.attention.backend import to_device
from replica.core.request import Request
from replica.core.scheduler_output import ScheduledRequest
from replica.protocol.sampling_params import SamplingParams
from replica.worker.input_batch import InputBatch


def _request(rid: str, prompt: list[int], blocks: list[int]) -> Request:
    request = Request(request_id=rid, prompt_token_ids=prompt, sampling_params=SamplingParams())
    request.block_ids = blocks
    return request


def test_prefill_then_decode_rows():
    batch = InputBatch(max_rows=4, max_model_len=64, block_size=4, padding_slot=99)
    a = _request("a", [10, 11, 12, 13, 14], [7, 3])
    b = _request("b", [20, 21], [5])
    step = batch.prepare([ScheduledRequest(a, 0, 5, True), ScheduledRequest(b, 0, 2, True)], pad=False)
    assert step.input_ids.tolist() == [10, 11, 12, 13, 14, 20, 21]
    assert step.positions.tolist() == [0, 1, 2, 3, 4, 0, 1]
    assert step.sequences.slot_mapping.tolist() == [28, 29, 30, 31, 12, 20, 21]
    assert step.logits_indices.tolist() == [4, 6]
    assert step.sequences.block_tables.tolist() == [[7, 3], [5, 0]]
    # Next step: each decodes the token just sampled; b has grown a block.
    a.output_token_ids.append(15)
    b.output_token_ids.append(22)
    b.output_token_ids.append(23)
    b.block_ids = [5]
    step = batch.prepare([ScheduledRequest(a, 5, 1, True), ScheduledRequest(b, 3, 1, True)], pad=False)
    assert step.input_ids.tolist() == [15, 23]
    assert step.positions.tolist() == [5, 3]
    assert step.sequences.slot_mapping.tolist() == [3 * 4 + 1, 5 * 4 + 3]
    assert step.sequences.seq_lens.tolist() == [6, 4]


def test_padding_and_forget():
    batch = InputBatch(max_rows=2, max_model_len=64, block_size=4, padding_slot=99)
    reqs = [_request(f"r{i}", list(range(1, 10 + i)), [i * 4 + j for j in range(4)]) for i in range(2)]
    step = batch.prepare([ScheduledRequest(r, 0, r.num_tokens, True) for r in reqs], pad=True)
    assert len(step.input_ids) == 20  # 9 + 10 tokens padded to the bucket of 19
    assert step.sequences.slot_mapping[19:].tolist() == [99]
    assert step.sequences.num_tokens == 20 and step.sample_rows == [0, 1]
    assert batch.num_rows_used == 2
    batch.forget("r0")
    fresh = _request("r2", [42, 43], [11])
    step = batch.prepare([ScheduledRequest(fresh, 0, 2, True)], pad=False)
    assert step.input_ids.tolist() == [42, 43] and batch.num_rows_used == 2


def test_logits_rows_are_padded_when_the_tokens_already_fill_a_bucket():
    """18 decodes and a 2-token chunk: 20 tokens is a bucket already, and the 19 rows that sample
    are padded to 20 as well, so the output layer only ever sees warmed-up row counts."""
    from replica.kernels.shapes import padded_size

    batch = InputBatch(max_rows=32, max_model_len=64, block_size=16, padding_slot=999)
    scheduled = []
    for i in range(19):
        request = _request(str(i), [5, 6, 7, 8], [i])
        start = 2 if i == 18 else 3
        scheduled.append(ScheduledRequest(request, start, 4 - start, True))
    step = batch.prepare(scheduled, pad=True)
    assert step.sequences.num_tokens == 20 == padded_size(20)
    assert len(step.logits_indices) == padded_size(19) == 20 and len(step.sample_rows) == 19
    assert step.logits_indices[19] == step.logits_indices[18]  # padding repeats the last real row


def test_to_device_on_cpu_is_a_view():
    arrays = [np.arange(5), np.arange(6).reshape(2, 3)]
    tensors = to_device(arrays, torch.device("cpu"))
    assert [t.shape for t in tensors] == [(5,), (2, 3)]
    arrays[0][0] = 7
    assert tensors[0][0].item() == 7


def test_packed_context_slots():
    from replica.attention.cuda import packed_context_slots

    tables = torch.tensor([[3, 1], [2, 0]])
    seq_lens = torch.tensor([5, 2])
    cu = torch.tensor([0, 5, 7])
    slots = packed_context_slots(tables, seq_lens, cu, 7, block_size=4)
    assert slots.tolist() == [12, 13, 14, 15, 4, 8, 9]


def test_min_rows_pads_the_tokens_and_the_logits_rows_of_a_small_step():
    """float32 on CPU without Carpool's float32 kernel runs at least 4 tokens and 4 logits rows
    (``ModelRunner.min_rows``): one
    decode becomes 4 tokens (3 on the spare slot) and 4 logits rows (the real one repeated)."""
    batch = InputBatch(max_rows=4, max_model_len=64, block_size=4, padding_slot=99)
    request = _request("a", [1, 2, 3, 4, 5], [7, 8])
    step = batch.prepare([ScheduledRequest(request, 4, 1, True)], pad=False, min_rows=4)
    assert step.input_ids.tolist() == [5, 0, 0, 0] and step.sequences.num_tokens == 4
    assert step.sequences.slot_mapping.tolist() == [8 * 4 + 0, 99, 99, 99]
    assert step.logits_indices.tolist() == [0, 0, 0, 0] and step.sample_rows == [0]
    # A step that already has 4 rows is left as it is.
    big = [ScheduledRequest(_request(f"b{i}", [1, 2], [i]), 0, 2, True) for i in range(3)]
    step = batch.prepare(big, pad=False, min_rows=4)
    assert step.sequences.num_tokens == 6 and step.logits_indices.tolist() == [1, 3, 5, 5]
