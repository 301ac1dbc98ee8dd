"""Priorities (``scheduling_policy="priority"``, vLLM's semantics: lower runs first) on a real
engine: tokens never change because of priority (greedy, fp32, eager, the tiny Llama), even with
high-priority arrivals preempting running requests, synchronous and with async scheduling; the
queue order shows in which request finishes first; a nonzero priority is refused under ``fcfs``
by the field's name; the preemptions, queue waits and TTFTs are counted by priority.
"""

from __future__ import annotations

import random

import pytest

from replica import LLM, SamplingParams
from replica.engine.llm_engine import LLMEngine
from replica.engine.metrics import EngineMetrics
from replica.protocol.errors import RequestError
from tests.helpers import ON_TEST_DEVICE, assert_idle

LABELS = {"model_name": "tiny", "replica": "r0"}


def _workload(seed: int = 7) -> list[tuple[list[int], int, int]]:
    """10 (prompt ids, max_tokens, priority): 6 of low priority (2) first, then 4 that outrank them."""
    rng = random.Random(seed)
    lows = [([rng.randrange(3, 49152) for _ in range(rng.randint(8, 40))], rng.randint(12, 24), 2) for _ in range(6)]
    highs = [([rng.randrange(3, 49152) for _ in range(rng.randint(8, 40))], rng.randint(6, 16), p) for p in (0, 1, -1, 0)]
    return lows + highs


WORKLOAD = _workload()
ENGINE = dict(dtype="float32", compile=False, **ON_TEST_DEVICE)


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens)


@pytest.fixture(scope="module")
def alone_tokens(tiny_llama) -> list[list[int]]:
    """Each request run alone on an fcfs engine: the oracle."""
    llm = LLM(model=tiny_llama, **ENGINE, max_num_seqs=4)
    outs = [llm.generate(prompt_token_ids=[ids], sampling_params=_params(m))[0].outputs[0].token_ids for ids, m, _ in WORKLOAD]
    assert_idle(llm.engine)
    return outs


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_tokens_do_not_change_with_priorities_and_preemptions(tiny_llama, alone_tokens, async_scheduling):
    """3 seats and 10 blocks of 16 tokens: the low-priority requests fill the seats, then each
    high-priority arrival preempts one of them (and blocks run out as they grow)."""
    metrics = EngineMetrics("tiny", "r0")
    engine = LLMEngine(
        model=tiny_llama, **ENGINE, max_num_seqs=3, num_blocks=10, max_model_len=160, scheduling_policy="priority",
        async_scheduling=async_scheduling, metrics=metrics,
    )
    # Priority 0's series exist before any request (at 0), the others once used.
    for name in ("num_preemptions_by_priority_total", "request_queue_time_by_priority_seconds_count",
                 "time_to_first_token_by_priority_seconds_count"):
        assert metrics.registry.get_sample_value(f"carpool:{name}", {**LABELS, "priority": "0"}) == 0, name
        assert metrics.registry.get_sample_value(f"carpool:{name}", {**LABELS, "priority": "2"}) is None, name
    requests = [engine.make_request(None, prompt_token_ids=ids, sampling_params=_params(m), priority=p) for ids, m, p in WORKLOAD]
    pending, step = list(requests), 0
    while pending or engine.has_unfinished_requests():
        if pending and (step == 0 or (pending[0].priority < 2 and step % 3 == 0)):
            engine.add_prepared_request(pending.pop(0))
            while step == 0 and pending and pending[0].priority == 2:
                engine.add_prepared_request(pending.pop(0))
        engine.step()
        step += 1
        assert step < 2000
    assert [r.output_token_ids for r in requests] == alone_tokens
    lows, highs = requests[:6], requests[6:]
    assert sum(r.num_preemptions for r in lows) > 0
    assert all(r.num_preemptions == 0 for r in highs if r.priority <= 0)  # nothing outranks them
    # Preemptions and queue waits, counted by priority.
    preempted = {
        label: metrics.registry.get_sample_value("carpool:num_preemptions_by_priority_total", {**LABELS, "priority": label}) or 0
        for label in ("-1", "0", "1", "2")
    }
    assert sum(preempted.values()) == engine.scheduler.num_preemptions == metrics.registry.get_sample_value(
        "carpool:num_preemptions_total", LABELS)
    assert preempted["2"] > 0 and preempted["-1"] == preempted["0"] == 0
    for label, count in (("2", 6), ("0", 2), ("1", 1), ("-1", 1)):
        for name in ("request_queue_time_by_priority_seconds_count", "time_to_first_token_by_priority_seconds_count"):
            assert metrics.registry.get_sample_value(f"carpool:{name}", {**LABELS, "priority": label}) == count, name
    # Each request's TTFT once, in its priority's series: the series add up to the unlabelled histogram.
    ttft_by_priority = sum(
        metrics.registry.get_sample_value("carpool:time_to_first_token_by_priority_seconds_sum", {**LABELS, "priority": label})
        for label in ("-1", "0", "1", "2")
    )
    assert ttft_by_priority == pytest.approx(metrics.registry.get_sample_value("carpool:time_to_first_token_seconds_sum", LABELS))
    assert_idle(engine)


def test_queue_order_and_fcfs_refusal(tiny_llama):
    """One seat, all at once: requests finish in (priority, arrival) order under ``priority``;
    under ``fcfs`` a nonzero priority is refused by name, 0 is taken."""
    prompts = [ids for ids, _, _ in WORKLOAD[:4]]
    llm = LLM(model=tiny_llama, **ENGINE, max_num_seqs=1, scheduling_policy="priority")
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=_params(3), priority=[3, -2, 0, -2])
    finish = [o.metrics["finish_step"] for o in outs]
    assert sorted(range(4), key=lambda i: finish[i]) == [1, 3, 2, 0]
    assert [o.outputs[0].token_ids for o in outs] == [t[:3] for t in _alone_prefixes(llm, prompts)]
    with pytest.raises(ValueError, match="priority has 1 entries for 4 prompts"):
        llm.generate(prompt_token_ids=prompts, sampling_params=_params(3), priority=[0])
    with pytest.raises(ValueError, match="priority must be one int per prompt"):
        llm.generate(prompt_token_ids=prompts, sampling_params=_params(3), priority=5)
    with pytest.raises(RequestError, match="priority must be an integer, got float") as info:
        llm.generate(prompt_token_ids=prompts[:1], sampling_params=_params(3), priority=[1.5])
    assert info.value.param == "priority"
    assert_idle(llm.engine)

    llm.engine.set_scheduling_policy("fcfs")
    with pytest.raises(RequestError, match="priority 1 is only applicable when the scheduling policy is 'priority'"):
        llm.generate(prompt_token_ids=prompts[:2], sampling_params=_params(3), priority=[0, 1])
    assert llm.generate(prompt_token_ids=prompts[:1], sampling_params=_params(3), priority=[0])[0].finished
    assert_idle(llm.engine)


def _alone_prefixes(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [llm.generate(prompt_token_ids=[p], sampling_params=_params(3))[0].outputs[0].token_ids for p in prompts]


def test_a_priority_preemption_is_counted_reported_and_its_seat_taken_in_the_same_step(tiny_llama):
    """One seat: a priority-0 arrival preempts the running priority-5 request and takes its seat in
    the same step (its prompt's prefill is the step's one row); the preemption is counted by
    priority (5 is in the label ">=4") and reported to step observers."""
    metrics = EngineMetrics("tiny", "r0")
    engine = LLMEngine(model=tiny_llama, **ENGINE, max_num_seqs=1, scheduling_policy="priority", metrics=metrics)
    records = []
    engine.add_step_observer(records.append)
    low = engine.add_request(prompt_token_ids=WORKLOAD[0][0], sampling_params=_params(8), priority=5)
    engine.step()
    high = engine.add_request(prompt_token_ids=WORKLOAD[1][0], sampling_params=_params(4), priority=0)
    engine.step()
    assert engine.scheduler.num_preemptions == 1 and low.num_preemptions == 1
    assert records[-1].preempted == (low.request_id,)
    assert [row.request_id for row in records[-1].rows] == [high.request_id]
    assert records[-1].num_batched_tokens == len(WORKLOAD[1][0])
    assert metrics.registry.get_sample_value("carpool:num_preemptions_total", LABELS) == 1
    assert metrics.registry.get_sample_value("carpool:num_preemptions_by_priority_total", {**LABELS, "priority": ">=4"}) == 1
    while engine.has_unfinished_requests():
        engine.step()
    assert high.output_token_ids and len(low.output_token_ids) == 8
    assert_idle(engine)
