"""The engine's public read side (``replica/engine/reporting.py``), which the benchmarks use instead
of its internals: step records to observers, ``info()``, the forward's cost by size, and the LoRA
seams ``add_lora``/``activate_lora``. On the tiny Llama (conftest's ``engine``: 4 seats, 32
blocks of 16 tokens)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from replica import LLM, LoRARequest
from replica.engine.stats import EngineInfo, StepRecord
from replica.protocol.errors import LoRAAdapterError
from tests.engine.tiny_engine import PROMPT, greedy
from tests.helpers import ON_TEST_DEVICE, assert_idle


def _run(engine, lengths: list[int], prompt=PROMPT) -> list:
    """Queue one request per length (greedy, exact length), step to the end; the requests."""
    requests = [engine.add_request(None, prompt_token_ids=list(prompt), sampling_params=greedy(max_tokens=n, ignore_eos=True))
                for n in lengths]
    while engine.has_unfinished_requests():
        engine.step()
    return requests


def test_each_step_that_ran_work_is_recorded_in_order(engine):
    records: list[StepRecord] = []
    remove = engine.add_step_observer(records.append)
    first = engine.stats().num_steps
    try:
        short, long = _run(engine, [2, 4])
    finally:
        remove()
    assert_idle(engine)
    assert [r.step for r in records] == list(range(first + 1, engine.stats().num_steps + 1))
    ids = (short.request_id, long.request_id)
    prefill = records[0]
    assert [(row.request_id, row.start, row.num_tokens, row.is_prefill) for row in prefill.rows] == [
        (rid, 0, len(PROMPT), True) for rid in ids
    ]
    assert (prefill.num_prefill_rows, prefill.num_decode_rows, prefill.num_batched_tokens) == (2, 0, 2 * len(PROMPT))
    assert prefill.running == ids and prefill.preempted == ()
    # Each decode row computes the token sampled the step before: the long one's last is its 3rd output.
    decodes = [row for record in records[1:] for row in record.rows]
    assert all(not row.is_prefill and row.num_tokens == 1 and not row.is_padding for row in decodes)
    assert [row.start for row in decodes if row.request_id == long.request_id] == [len(PROMPT) + k for k in range(3)]
    assert records[-1].running == ()  # both finished; the short one left first
    assert any(record.running == (long.request_id,) for record in records)
    for record in records:
        assert record.num_total_blocks == 32 and record.num_used_blocks == 32 - record.num_free_blocks
        assert record.duration_s >= 0
    assert records[0].num_used_blocks == 2  # one block of 16 tokens per request while both run
    assert records[-1].num_used_blocks == 0
    assert [r.started for r in records] == sorted(r.started for r in records)


def test_a_removed_observer_is_not_called_again(engine):
    calls = []
    remove = engine.add_step_observer(calls.append)
    _run(engine, [1])
    assert len(calls) == 1
    remove()
    remove()  # idempotent
    _run(engine, [2])
    assert len(calls) == 1
    assert_idle(engine)


def test_a_failing_observer_is_logged_and_removed_and_the_step_goes_on(engine, caplog):
    seen = []

    def broken(record):
        raise RuntimeError("observer bug")

    remove_broken = engine.add_step_observer(broken)
    remove_seen = engine.add_step_observer(seen.append)
    try:
        with caplog.at_level(logging.ERROR):
            [request] = _run(engine, [3])
    finally:
        remove_broken()
        remove_seen()
    assert request.num_output_tokens == 3 and request.finish_reason.value == "length"
    assert len(seen) == 3  # the other observer saw every step
    assert caplog.text.count("step observer") == 1 and "observer bug" in caplog.text
    assert_idle(engine)


def test_no_record_is_built_without_observers(engine, monkeypatch):
    import replica.engine.reporting as reporting

    def refuse(*args, **kwargs):
        raise AssertionError("a StepRecord was built with no observer")

    monkeypatch.setattr(reporting.StepRecord, "of", refuse)
    _run(engine, [2])
    assert_idle(engine)


def test_info_reports_the_settings_in_effect(engine, tiny_llama):
    info = engine.info()
    assert isinstance(info, EngineInfo)
    assert (info.model, info.dtype, info.block_size, info.num_blocks, info.max_num_seqs, info.max_model_len) == (
        tiny_llama, "float32", 16, 32, 4, 128
    )
    assert Path(info.model_path).is_dir() and info.device.startswith(ON_TEST_DEVICE["device"])
    assert (info.batching_policy, info.scheduling_policy) == ("continuous", "fcfs") and info.speculative_config is None
    assert info.max_num_batched_tokens == engine.config.max_num_batched_tokens
    assert info.tensor_parallel_size == 1 and info.enable_prefix_caching is engine.config.enable_prefix_caching
    if info.device == "cpu":
        assert info.async_scheduling is False and info.cuda_graphs is False
    engine.set_batching_policy("static")
    try:
        static = engine.info()
        assert static.batching_policy == "static" and static.async_scheduling is False  # static runs synchronously
        engine.set_scheduling_policy("priority")  # keeps the batching policy
        assert (engine.info().batching_policy, engine.info().scheduling_policy) == ("static", "priority")
        with pytest.warns(FutureWarning, match="set_scheduling_policy 'continuous' is deprecated"):
            engine.set_scheduling_policy("continuous")  # the former name: the batching policy
        assert (engine.info().batching_policy, engine.info().scheduling_policy) == ("continuous", "priority")
    finally:
        engine.set_batching_policy("continuous")
        engine.set_scheduling_policy("fcfs")


def test_time_forwards_gives_seconds_per_size(engine):
    seconds = engine.time_forwards([1, 8], 4)
    assert len(seconds) == 2 and all(0 < s < 60 for s in seconds)
    assert_idle(engine)


# ---- LoRA: add_lora and activate_lora ---------------------------------------------------------
@pytest.fixture(scope="module")
def lora_llm(tiny_llama, tmp_path_factory):
    from tests.lora_adapters import make_adapter

    folder = tmp_path_factory.mktemp("reporting-lora")
    paths = [make_adapter(tiny_llama, folder / f"a{k}", r=4, seed=k) for k in range(3)]
    llm = LLM(model=tiny_llama, dtype="float32", **ON_TEST_DEVICE, max_num_seqs=2, block_size=16, num_blocks=32,
              max_model_len=128, enable_lora=True, max_loras=2, max_lora_rank=8)
    yield llm, [LoRARequest(f"a{k}", k + 1, p) for k, p in enumerate(paths)]
    llm.close()


def test_add_lora_reads_an_adapter_into_host_memory(lora_llm):
    llm, adapters = lora_llm
    described = llm.engine.add_lora(adapters[0])
    assert (described["name"], described["path"], described["rank"]) == ("a0", adapters[0].lora_path, 4)
    assert "a0" in llm.engine.lora_stats()["cached"]
    with pytest.raises(LoRAAdapterError):
        llm.engine.add_lora(LoRARequest("missing", 9, "/nonexistent/adapter"))


def test_activate_lora_writes_a_slot_once_and_spares_running_adapters(lora_llm):
    llm, (a0, a1, a2) = lora_llm
    engine = llm.engine
    assert engine.activate_lora(a0) is True
    assert engine.activate_lora(a0) is False  # already in a slot
    assert "a0" in engine.lora_stats()["loaded"]
    assert engine.activate_lora(a1) is True
    # a1's request runs: activating a2 must take a0's slot, not a1's.
    request = engine.add_request(None, prompt_token_ids=list(PROMPT), sampling_params=greedy(max_tokens=4), lora_request=a1)
    engine.step()
    assert engine.activate_lora(a2) is True
    assert sorted(engine.lora_stats()["loaded"]) == ["a1", "a2"]
    while engine.has_unfinished_requests():
        engine.step()
    assert request.num_output_tokens == 4
    assert_idle(engine)


def test_lora_seams_refuse_an_engine_without_lora(engine):
    with pytest.raises(LoRAAdapterError, match="enable_lora"):
        engine.add_lora(LoRARequest("a", 1, "/nonexistent"))
    with pytest.raises(LoRAAdapterError, match="enable_lora"):
        engine.activate_lora(LoRARequest("a", 1, "/nonexistent"))


def test_async_scheduling_records_each_scheduled_step_once(tiny_llama):
    """With async scheduling a ``step()`` call schedules one step and finishes the one before: the
    records still number the scheduled steps 1, 2, ... and hold each request's rows once."""
    llm = LLM(model=tiny_llama, dtype="float32", **ON_TEST_DEVICE, max_num_seqs=4, block_size=16, num_blocks=32,
              max_model_len=128, async_scheduling=True)
    engine = llm.engine
    assert engine.info().async_scheduling is True
    records: list[StepRecord] = []
    engine.add_step_observer(records.append)
    short, long = _run(engine, [2, 4])
    assert [r.step for r in records] == list(range(1, engine.stats().num_steps + 1))
    rows = {rid: [(row.start, row.is_prefill) for record in records for row in record.rows if row.request_id == rid]
            for rid in (short.request_id, long.request_id)}
    n = len(PROMPT)
    assert rows[short.request_id] == [(0, True), (n, False)]
    assert rows[long.request_id] == [(0, True), (n, False), (n + 1, False), (n + 2, False)]
    assert (short.num_output_tokens, long.num_output_tokens) == (2, 4)
    assert_idle(engine)
    llm.close()
