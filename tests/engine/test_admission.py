"""Admission by latency target on a real engine (the tiny Llama, fp32, eager, synchronous
scheduling): the snapshot lists each running request's steps left and each waiting request's
steps, exactly as ``replica/engine/admission.py`` counts them; the step cost is measured; the
prediction follows the queue; requests with targets are counted met or missed when they finish
(``carpool:requests_slo_total``), requests without targets are not, and tokens do not change."""

from __future__ import annotations

from replica import LLM, SamplingParams
from replica.engine.admission import predict_ttft_s
from replica.engine.llm_engine import LLMEngine
from replica.engine.metrics import EngineMetrics
from replica.protocol.slo import LatencyTargets
from tests.helpers import ON_TEST_DEVICE, assert_idle

LABELS = {"model_name": "tiny", "replica": "r0"}
ENGINE = dict(dtype="float32", compile=False, async_scheduling=False, **ON_TEST_DEVICE)
PROMPTS = [[5, 6, 7, 8, 9] * 4, [11, 12, 13] * 7, [21, 22] * 9]  # 20, 21, 18 tokens
MAX_TOKENS = [8, 6, 4]


def slo_count(metrics: EngineMetrics, outcome: str) -> float:
    return metrics.registry.get_sample_value("carpool:requests_slo_total", {**LABELS, "outcome": outcome})


def test_the_snapshot_predicts_from_the_queue_and_targets_are_counted(tiny_llama):
    metrics = EngineMetrics("tiny", "r0")
    engine = LLMEngine(model=tiny_llama, **ENGINE, max_num_seqs=2, max_num_batched_tokens=64, metrics=metrics)
    assert engine.stats().step_time_s is None and predict_ttft_s(engine.stats(), 10) is None
    assert [slo_count(metrics, o) for o in ("met", "missed", "shed")] == [0, 0, 0]
    slos = [LatencyTargets(ttft_s=60.0), LatencyTargets(ttft_s=1e-9), None]  # met, missed, not counted
    requests = []
    for ids, m, slo in zip(PROMPTS, MAX_TOKENS, slos):
        request = engine.make_request(None, prompt_token_ids=ids, sampling_params=SamplingParams(temperature=0, max_tokens=m))
        request.slo = slo
        engine.add_prepared_request(request)
        requests.append(request)
    stats = engine.stats()
    # one prefill step each (the budget holds the prompt), which samples the first of their tokens
    assert stats.seat_steps == () and stats.waiting_steps == ((0, 1 + 7), (0, 1 + 5), (0, 1 + 3))
    engine.step()  # both seats prefill and sample their first token
    stats = engine.stats()
    assert stats.step_time_s is not None and stats.step_time_s > 0 and stats.token_budget == 64
    assert stats.seat_steps == (6 - 1, 8 - 1) and stats.waiting_steps == ((0, 1 + 3),)
    # after the step in flight, the waiting request takes the seat that frees after 5 steps; a new
    # one the other, after 7, and prefills in 1
    assert predict_ttft_s(stats, 10) == (1 + 7 + 1) * stats.step_time_s
    while engine.has_unfinished_requests():
        engine.step()
    assert [slo_count(metrics, o) for o in ("met", "missed", "shed")] == [1, 1, 0]
    assert_idle(engine)

    alone = LLM(model=tiny_llama, **ENGINE, max_num_seqs=1)
    for request, ids, m in zip(requests, PROMPTS, MAX_TOKENS):
        expected = alone.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(temperature=0, max_tokens=m))
        assert request.output_token_ids == expected[0].outputs[0].token_ids
