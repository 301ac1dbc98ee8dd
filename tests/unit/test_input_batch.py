"""The persistent batch builds a step's flat inputs from the scheduler's rows: token ids, positions
and KV slots of every scheduled token, rows kept across steps and freed when forgotten."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replica.attention.backend import to_device
from replica.core.request import Request, RequestStatus
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


# ---- the sampling half: settings per seat (replica/worker/sampling_batch.py) --------------------


def _sampling_request(rid: str, **params) -> Request:
    request = Request(request_id=rid, prompt_token_ids=[4, 5, 6], sampling_params=SamplingParams(**params),
                      eos_token_ids=(2,))
    request.block_ids = [1]
    return request


def test_a_request_s_sampling_settings_are_written_when_it_takes_a_seat_and_cleared_when_it_leaves():
    batch = InputBatch(max_rows=3, max_model_len=64, block_size=4, padding_slot=99)
    a = _sampling_request("a", temperature=0.0, logprobs=3, min_tokens=2, stop_token_ids=[9])
    b = _sampling_request("b", temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, repetition_penalty=1.3,
                          logit_bias={7: -100.0, 3: 2.5}, ignore_eos=True, seed=11)
    step = batch.prepare([ScheduledRequest(a, 0, 3, True), ScheduledRequest(b, 0, 3, True)], pad=False)
    seats = batch.sampling
    # b first, a second: the order of the rows, not of the seats.
    rows = seats.gather(step.seats[[1, 0]])
    assert rows.greedy.tolist() == [False, True]
    assert rows.temperature.tolist() == pytest.approx([0.7, 0.0])
    assert rows.top_k.tolist() == [5, 0] and rows.top_p.tolist() == pytest.approx([0.9, 1.0])
    assert rows.min_p.tolist() == pytest.approx([0.1, 0.0])
    assert rows.penalized.tolist() == [True, False] and rows.repetition_penalty.tolist() == pytest.approx([1.3, 1.0])
    assert rows.num_logprobs.tolist() == [-1, 3] and rows.min_tokens.tolist() == [0, 2]
    assert rows.has_bias.tolist() == [True, False] and rows.logit_bias[1] is None
    assert rows.logit_bias[0].token_ids.tolist() == [7, 3] and rows.logit_bias[0].biases.tolist() == [-100.0, 2.5]
    assert rows.end_ids == [frozenset(), frozenset({2, 9})]  # b ignores EOS and has no stop ids
    assert rows.prompt_token_ids[0].tolist() == [4, 5, 6] and rows.prompt_token_ids[1] is None
    assert rows.generators[1] is None and isinstance(rows.generators[0], torch.Generator)
    # The output tokens are the request's own list: what the scheduler appends is seen.
    a.output_token_ids.append(8)
    assert seats.gather(step.seats[:1]).output_token_ids == [[8]]
    # A seat's settings are written once: a later step gathers the same objects.
    again = batch.prepare([ScheduledRequest(b, 3, 1, True)], pad=False)
    assert seats.gather(again.seats).generators[0] is rows.generators[0]
    b.status = a.status = RequestStatus.FINISHED
    batch.forget("b")
    batch.forget("a")
    assert seats.num_parked == 0
    fresh = batch.prepare([ScheduledRequest(_sampling_request("c"), 0, 3, True)], pad=False)
    plain = seats.gather(fresh.seats)
    assert plain.greedy.tolist() == [False] and plain.generators == [None] and plain.has_bias.tolist() == [False]


def test_a_preempted_request_keeps_its_generator_and_a_finished_one_drops_it():
    batch = InputBatch(max_rows=2, max_model_len=64, block_size=4, padding_slot=99)
    r = _sampling_request("r", seed=5)
    step = batch.prepare([ScheduledRequest(r, 0, 3, True)], pad=False)
    generator = batch.sampling.gather(step.seats).generators[0]
    torch.rand(3, generator=generator)  # a few draws
    state = generator.get_state()
    r.status = RequestStatus.WAITING  # preempted
    batch.forget("r")
    assert batch.sampling.num_parked == 1
    batch.forget("r")  # released again while waiting: still kept
    assert batch.sampling.num_parked == 1
    r.status = RequestStatus.RUNNING
    step = batch.prepare([ScheduledRequest(r, 0, 3, True)], pad=False)
    back = batch.sampling.gather(step.seats).generators[0]
    assert back is generator and torch.equal(back.get_state(), state)  # drawing goes on where it was
    r.status = RequestStatus.FINISHED
    batch.forget("r")
    assert batch.sampling.num_parked == 0
    # Preempted, then aborted while waiting (released without a seat): dropped too.
    s = _sampling_request("s", seed=6)
    batch.prepare([ScheduledRequest(s, 0, 3, True)], pad=False)
    s.status = RequestStatus.WAITING
    batch.forget("s")
    assert batch.sampling.num_parked == 1
    s.status = RequestStatus.FINISHED
    batch.forget("s")
    assert batch.sampling.num_parked == 0


def test_settings_that_cannot_be_written_stay_with_the_seat():
    """Past validation, a broken setting does not fail the step's inputs: the seat holds the error
    (the step sampler fails that row alone) and its batch mates gather as usual."""
    batch = InputBatch(max_rows=2, max_model_len=64, block_size=4, padding_slot=99)
    broken, fine = _sampling_request("x"), _sampling_request("y", seed=3)
    broken.sampling_params.temperature = None
    step = batch.prepare([ScheduledRequest(broken, 0, 3, True), ScheduledRequest(fine, 0, 3, True)], pad=False)
    seats = batch.sampling
    assert isinstance(seats.error_of(int(step.seats[0])), TypeError) and seats.error_of(int(step.seats[1])) is None
    assert seats.num_errors == 1 and seats.gather(step.seats[1:]).generators[0] is not None
    broken.status = RequestStatus.FINISHED
    batch.forget("x")
    assert seats.num_errors == 0
