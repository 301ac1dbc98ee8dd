"""Engine-level metric updates, read back from the engine's own Prometheus registry."""

from __future__ import annotations

from replica.engine.llm_engine import LLMEngine
from replica.engine.metrics import EngineMetrics
from replica.protocol.sampling_params import SamplingParams
from tests.helpers import ON_TEST_DEVICE, assert_idle

LABELS = {"model_name": "tiny", "replica": "r0"}


def value(metrics: EngineMetrics, name: str, **extra) -> float:
    v = metrics.registry.get_sample_value(name, {**LABELS, **extra})
    assert v is not None, f"no sample {name} {extra}"
    return v


def make_engine(path, **kwargs):
    metrics = EngineMetrics("tiny", "r0")
    engine = LLMEngine(model=path, dtype="float32", **ON_TEST_DEVICE, metrics=metrics, **kwargs)
    return engine, metrics


def run_all(engine):
    while engine.has_unfinished_requests():
        engine.step()


def test_counts_tokens_latencies_and_finish_reasons_once(tiny_llama):
    engine, m = make_engine(tiny_llama, max_num_seqs=4)
    assert value(m, "carpool:num_slots") == 4
    lengths = [3, 5, 1, 8, 2]
    prompts = [[10 + i] * (4 + i) for i in range(5)]
    for ids, n in zip(prompts, lengths):
        engine.add_request(None, prompt_token_ids=ids, sampling_params=SamplingParams(max_tokens=n, ignore_eos=True, temperature=0))
    assert value(m, "carpool:num_requests_waiting") == 5
    run_all(engine)
    assert value(m, "carpool:prompt_tokens_total") == sum(len(p) for p in prompts)
    assert value(m, "carpool:generation_tokens_total") == sum(lengths)
    # TTFT once per request; ITL once per later token.
    assert value(m, "carpool:time_to_first_token_seconds_count") == 5
    assert value(m, "carpool:inter_token_latency_seconds_count") == sum(lengths) - 5
    assert value(m, "carpool:e2e_request_latency_seconds_count") == 5
    assert value(m, "carpool:request_queue_time_seconds_count") == 5
    assert value(m, "carpool:request_success_total", finished_reason="length") == 5
    assert value(m, "carpool:request_success_total", finished_reason="stop") == 0
    steps = engine.scheduler.step_count
    assert value(m, "carpool:iteration_tokens_total_count") == steps
    assert value(m, "carpool:iteration_tokens_total_sum") == sum(len(p) for p in prompts) + sum(lengths) - 5
    assert value(m, "carpool:batch_occupancy_count") == steps
    # Gauges back to idle.
    assert value(m, "carpool:num_requests_running") == 0
    assert value(m, "carpool:num_requests_waiting") == 0
    assert value(m, "carpool:kv_cache_usage_perc") == 0
    assert value(m, "carpool:kv_cache_blocks_free") == value(m, "carpool:kv_cache_blocks_total")
    assert_idle(engine)


def test_aborts_preemptions_and_rejections(tiny_llama):
    engine, m = make_engine(tiny_llama, max_num_seqs=8, num_blocks=6, max_model_len=96)
    params = SamplingParams(max_tokens=60, ignore_eos=True, temperature=0)
    ids = [engine.add_request(None, prompt_token_ids=[5 + i] * 20, sampling_params=params).request_id for i in range(4)]
    for _ in range(3):
        engine.step()
    assert value(m, "carpool:num_requests_running") > 0
    assert 0 < value(m, "carpool:kv_cache_usage_perc") <= 1
    engine.abort(ids[0])
    engine.abort(ids[0])  # a second abort of the same request counts nothing
    try:
        engine.add_request(None, prompt_token_ids=[], sampling_params=params)
    except ValueError:
        pass
    run_all(engine)
    assert value(m, "carpool:request_success_total", finished_reason="abort") == 1
    assert value(m, "carpool:requests_aborted_total") == 1
    assert value(m, "carpool:requests_rejected_total") == 1
    assert value(m, "carpool:request_success_total", finished_reason="length") == 3
    assert engine.scheduler.num_preemptions > 0
    assert value(m, "carpool:num_preemptions_total") == engine.scheduler.num_preemptions
    assert value(m, "carpool:num_requests_running") == 0
    assert value(m, "carpool:kv_cache_usage_perc") == 0
    assert_idle(engine)


def test_exposition_has_prefix_and_labels(tiny_llama):
    engine, m = make_engine(tiny_llama)
    text = m.exposition().decode()
    assert 'carpool:num_requests_running{model_name="tiny",replica="r0"} 0.0' in text
    assert "carpool:time_to_first_token_seconds_bucket" in text


def test_ingress_refusals_merge_with_the_replicas_series(tiny_llama):
    from prometheus_client.parser import text_string_to_metric_families

    from router.observability.metrics import IngressMetrics, merge_expositions

    _, m = make_engine(tiny_llama)
    ingress = IngressMetrics(model_name="tiny", replica="ingress-1")
    ingress.on_rejected(429, "overloaded")
    ingress.on_rejected(429, "overloaded")
    ingress.on_rejected(404, None)
    merged = merge_expositions([m.exposition().decode(), ingress.exposition().decode()]).decode()
    samples = {
        (s.labels["status"], s.labels["code"]): s.value
        for f in text_string_to_metric_families(merged) if f.name == "carpool:http_requests_rejected"
        for s in f.samples if s.name.endswith("_total")
    }
    assert samples[("429", "overloaded")] == 2 and samples[("404", "none")] == 1
    assert samples[("401", "invalid_api_key")] == 0  # present before the first refusal
    assert 'carpool:num_requests_running{model_name="tiny",replica="r0"}' in merged


def test_spec_decode_counters_sum_over_steps_with_a_series_per_position():
    from prometheus_client.parser import text_string_to_metric_families

    m = EngineMetrics("tiny", "r0")
    assert value(m, "carpool:spec_decode_num_drafts_total") == 0  # present before the first draft
    # Step 1: 3 rows drafted 2 tokens each; accepted prefixes 2, 1, 0.
    m.on_spec_decode(num_drafts=3, num_draft_tokens=6, num_accepted_tokens=3, accepted_per_position=[2, 1])
    # Step 2: 2 rows drafted 3 tokens each; accepted prefixes 0, 0 (position zeros still counted).
    m.on_spec_decode(num_drafts=2, num_draft_tokens=6, num_accepted_tokens=0, accepted_per_position=[0, 0, 0])
    text = m.exposition().decode()
    totals = {
        f.name: s.value
        for f in text_string_to_metric_families(text) if f.name.startswith("carpool:spec_decode_num_")
        for s in f.samples if s.name.endswith("_total") and "position" not in s.labels
    }
    assert totals == {
        "carpool:spec_decode_num_drafts": 5,
        "carpool:spec_decode_num_draft_tokens": 12,
        "carpool:spec_decode_num_accepted_tokens": 3,
    }
    per_position = {
        s.labels["position"]: s.value
        for f in text_string_to_metric_families(text) if f.name == "carpool:spec_decode_num_accepted_tokens_per_pos"
        for s in f.samples if s.name.endswith("_total")
    }
    assert per_position == {"0": 2, "1": 1, "2": 0}
    assert 'carpool:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="2",replica="r0"} 0.0' in text
