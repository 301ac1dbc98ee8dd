"""Writes grafana/carpool.json, the Carpool dashboard (run: python grafana/make_dashboard.py).

The JSON is committed; this script is how it is edited, so that every panel follows one layout
and every query uses the same label filters. Metric names are those of ``replica/engine/metrics.py``
(a replica's) and ``router/observability/metrics.py`` (the ingress's own).
"""

from __future__ import annotations

import json
from pathlib import Path

SEL = 'model_name=~"$model", replica=~"$replica"'
RATE = "$__rate_interval"


def quantiles(metric: str) -> list[tuple[str, str]]:
    return [
        (f"p{q}", f"histogram_quantile(0.{q}, sum by (le) (rate(carpool:{metric}_bucket{{{SEL}}}[{RATE}])))")
        for q in ("50", "90", "99")
    ]


# (title, description, unit, [(legend, expr)], kind); ROW starts a new row of panels.
ROW = "row"
PANELS = [
    ("Slot utilization per replica", "Running requests / seats (max_num_seqs), 0-1.", "percentunit",
     [("{{replica}}", f"carpool:slot_utilization{{{SEL}}}")], "timeseries"),
    ("Running vs waiting", "Requests in seats and requests queued for a seat, all replicas.", "short",
     [("running", f"sum(carpool:num_requests_running{{{SEL}}})"),
      ("waiting", f"sum(carpool:num_requests_waiting{{{SEL}}})"),
      ("seats", f"sum(carpool:num_slots{{{SEL}}})")], "timeseries"),
    ("KV cache usage per replica", "Fraction of KV blocks in use, 0-1.", "percentunit",
     [("{{replica}}", f"carpool:kv_cache_usage_perc{{{SEL}}}")], "timeseries"),
    ("Preemptions",
     "Preemptions by recompute per second (KV blocks ran out, or a request of higher priority needed the room).", "ops",
     [("{{replica}}", f"sum by (replica) (rate(carpool:num_preemptions_total{{{SEL}}}[{RATE}]))")], "timeseries"),
    ("Prefix cache hit rate per replica",
     "Prompt tokens found in the prefix cache / prompt tokens looked up, over the rate window (vLLM's hit rate).",
     "percentunit",
     [("{{replica}}", f"sum by (replica) (rate(carpool:prefix_cache_hits_total{{{SEL}}}[{RATE}])) / "
                      f"sum by (replica) (rate(carpool:prefix_cache_queries_total{{{SEL}}}[{RATE}]))"),
      ("all replicas", f"sum(rate(carpool:prefix_cache_hits_total{{{SEL}}}[{RATE}])) / "
                       f"sum(rate(carpool:prefix_cache_queries_total{{{SEL}}}[{RATE}]))")], "timeseries"),
    ("Token throughput", "Prompt tokens prefilled and tokens generated per second.", "short",
     [("prompt tok/s", f"sum(rate(carpool:prompt_tokens_total{{{SEL}}}[{RATE}]))"),
      ("generation tok/s", f"sum(rate(carpool:generation_tokens_total{{{SEL}}}[{RATE}]))")], "timeseries"),
    ("Time to first token", "TTFT quantiles: arrival to first generated token.", "s",
     quantiles("time_to_first_token_seconds"), "timeseries"),
    ("Inter-token latency", "ITL quantiles: time between two tokens of one request.", "s",
     quantiles("inter_token_latency_seconds"), "timeseries"),
    ("End-to-end request latency", "Arrival to finish.", "s",
     quantiles("e2e_request_latency_seconds"), "timeseries"),
    ("Queue time", "Arrival to first scheduled: time spent waiting for a seat.", "s",
     quantiles("request_queue_time_seconds"), "timeseries"),
    ("Finish reasons", "Finished requests per second by finish reason (stop, length, abort).", "reqps",
     [("{{finished_reason}}", f"sum by (finished_reason) (rate(carpool:request_success_total{{{SEL}}}[{RATE}]))")],
     "timeseries"),
    ("Tokens per step", "Tokens computed per engine step (prefill chunks + decodes): mean and p90.", "short",
     [("mean", f"sum(rate(carpool:iteration_tokens_total_sum{{{SEL}}}[{RATE}])) / sum(rate(carpool:iteration_tokens_total_count{{{SEL}}}[{RATE}]))"),
      ("p90", f"histogram_quantile(0.9, sum by (le) (rate(carpool:iteration_tokens_total_bucket{{{SEL}}}[{RATE}])))")],
     "timeseries"),
    ("Batch occupancy per step", "Seats taken / seats during each step, mean per replica.", "percentunit",
     [("{{replica}}", f"sum by (replica) (rate(carpool:batch_occupancy_sum{{{SEL}}}[{RATE}])) / sum by (replica) (rate(carpool:batch_occupancy_count{{{SEL}}}[{RATE}]))")],
     "timeseries"),
    ("Step duration", "Wall time of one engine step.", "s", quantiles("step_duration_seconds"), "timeseries"),
    ("Aborted and rejected", "Requests aborted (client gone) and refused at admission, per second.", "reqps",
     [("aborted", f"sum(rate(carpool:requests_aborted_total{{{SEL}}}[{RATE}]))"),
      ("rejected", f"sum(rate(carpool:requests_rejected_total{{{SEL}}}[{RATE}]))")], "timeseries"),
    ("HTTP errors by status", "Requests the ingress refused, per second, by status and error code (429 = overloaded).", "reqps",
     [("{{status}} {{code}}", f'sum by (status, code) (rate(carpool:http_requests_rejected_total{{model_name=~"$model"}}[{RATE}]))')],
     "timeseries"),
    ("KV blocks free", "Free KV blocks per replica (of the pool's total).", "short",
     [("{{replica}} free", f"carpool:kv_cache_blocks_free{{{SEL}}}"),
      ("{{replica}} total", f"carpool:kv_cache_blocks_total{{{SEL}}}")], "timeseries"),
    ("Speculative decoding: acceptance rate",
     "Accepted draft tokens / draft tokens verified, over the rate window (vLLM's draft acceptance rate). "
     "Empty (NaN) while nothing is drafted.", "percentunit",
     [("{{replica}}", f"sum by (replica) (rate(carpool:spec_decode_num_accepted_tokens_total{{{SEL}}}[{RATE}])) / "
                      f"sum by (replica) (rate(carpool:spec_decode_num_draft_tokens_total{{{SEL}}}[{RATE}]))"),
      ("all replicas", f"sum(rate(carpool:spec_decode_num_accepted_tokens_total{{{SEL}}}[{RATE}])) / "
                       f"sum(rate(carpool:spec_decode_num_draft_tokens_total{{{SEL}}}[{RATE}]))")], "timeseries"),
    ("Speculative decoding: mean acceptance length",
     "Tokens a verified row emits per step: 1 + accepted draft tokens / rows verified with drafts "
     "(vLLM's mean acceptance length; 1 = no draft kept).", "short",
     [("{{replica}}", f"1 + sum by (replica) (rate(carpool:spec_decode_num_accepted_tokens_total{{{SEL}}}[{RATE}])) / "
                      f"sum by (replica) (rate(carpool:spec_decode_num_drafts_total{{{SEL}}}[{RATE}]))"),
      ("all replicas", f"1 + sum(rate(carpool:spec_decode_num_accepted_tokens_total{{{SEL}}}[{RATE}])) / "
                       f"sum(rate(carpool:spec_decode_num_drafts_total{{{SEL}}}[{RATE}]))")], "timeseries"),
    ("Speculative decoding: accepted tokens per position",
     "Accepted draft tokens per second by draft position (0 = first draft token). "
     "Before any draft, one line at 0.", "short",
     [("position {{position}}",
       f"sum by (position) (rate(carpool:spec_decode_num_accepted_tokens_per_pos_total{{{SEL}}}[{RATE}])) "
       f"or on() (0 * sum(rate(carpool:spec_decode_num_drafts_total{{{SEL}}}[{RATE}])))")], "timeseries"),
    ("LoRA adapters", "", "", [], ROW),
    ("LoRA: requests running per adapter",
     "Requests running with each LoRA adapter, all replicas (one series per adapter the replicas know). "
     "Without adapters, one line at 0.", "short",
     [("{{adapter}}", f"sum by (adapter) (carpool:lora_requests_running{{{SEL}}}) "
                      f"or on() (0 * sum(carpool:lora_adapters_loaded{{{SEL}}}))")], "timeseries"),
    ("LoRA: requests waiting per adapter",
     "Requests with each LoRA adapter waiting for a seat or for a device slot for their adapter, all replicas. "
     "Without adapters, one line at 0.", "short",
     [("{{adapter}}", f"sum by (adapter) (carpool:lora_requests_waiting{{{SEL}}}) "
                      f"or on() (0 * sum(carpool:lora_adapters_loaded{{{SEL}}}))")], "timeseries"),
    ("LoRA: adapters in device slots", "Device slots holding an adapter, per replica (at most max_loras).", "short",
     [("{{replica}}", f"carpool:lora_adapters_loaded{{{SEL}}}")], "timeseries"),
    ("LoRA: adapter loads into a slot",
     "Adapters loaded into a device slot per second, per replica (each a miss: a request's adapter was not in a slot). "
     "Adapter-aware routing keeps it low.", "ops",
     [("{{replica}}", f"sum by (replica) (rate(carpool:lora_adapter_loads_total{{{SEL}}}[{RATE}]))")], "timeseries"),
    # Priorities (--scheduling-policy priority; under fcfs every request has priority 0) and latency targets.
    ("Priorities and latency targets", "", "", [], ROW),
    ("Queue time by priority",
     "90th percentile of arrival to first scheduled, per request priority (lower runs first).", "s",
     [("priority {{priority}}", f"histogram_quantile(0.9, sum by (le, priority) "
                                f"(rate(carpool:request_queue_time_by_priority_seconds_bucket{{{SEL}}}[{RATE}])))")],
     "timeseries"),
    ("Time to first token by priority",
     "90th percentile of arrival to first generated token, per request priority.", "s",
     [("priority {{priority}}", f"histogram_quantile(0.9, sum by (le, priority) "
                                f"(rate(carpool:time_to_first_token_by_priority_seconds_bucket{{{SEL}}}[{RATE}])))")],
     "timeseries"),
    ("Preemptions by priority",
     "Requests preempted per second, by the preempted request's priority. Without preemptions, one line at 0.", "ops",
     [("priority {{priority}}", f"sum by (priority) (rate(carpool:num_preemptions_by_priority_total{{{SEL}}}[{RATE}])) "
                                f"or on() (0 * sum(carpool:num_preemptions_total{{{SEL}}}))")], "timeseries"),
    ("Latency targets: outcomes",
     "Requests with latency targets (x-slo-ttft-ms, x-slo-tpot-ms headers) per second, by outcome: met (the "
     "goodput), missed (served late), shed (refused with 429 at arrival, as they asked with x-slo-shed).", "reqps",
     [("{{outcome}}", f"sum by (outcome) (rate(carpool:requests_slo_total{{{SEL}}}[{RATE}]))")], "timeseries"),
    # Autoscaling (the Carpool policy's series, per Serve application; empty while replicas are fixed).
    ("Autoscaling", "", "", [], ROW),
    ("Autoscaling: replicas",
     "Replicas the Carpool policy targets and replicas running, per application, with its bounds.", "short",
     [("target {{application}}", "carpool:autoscaler_target_replicas"),
      ("running {{application}}", "carpool:autoscaler_current_replicas"),
      ("max {{application}}", "carpool:autoscaler_max_replicas")], "timeseries"),
    ("Autoscaling: last decision",
     "The reason of the policy's last decision (seats_full_and_waiting, kv_cache_full, seats_underused, idle: "
     "a change; within_targets, up_delay, down_delay, cooldown, replicas_starting, no_reports: a hold), "
     "and the reason of the last change.", "short",
     [("{{reason}}", "max by (reason) (carpool:autoscaler_last_decision) > 0"),
      ("last change: {{reason}}", "max by (reason) (carpool:autoscaler_last_change) > 0")], "timeseries"),
    ("Autoscaling: seats and KV (policy inputs)",
     "Seat utilization (running / seats, all replicas) and the replicas' mean KV-block use, "
     "averaged over the policy's look-back window.", "percentunit",
     [("seats {{application}}", "carpool:autoscaler_seat_utilization"),
      ("KV {{application}}", "carpool:autoscaler_kv_cache_usage")], "timeseries"),
    ("Autoscaling: demand (policy input)",
     "Requests running, waiting for a seat or queued at the handles (demand), and those waiting, "
     "look-back averages, all replicas.", "short",
     [("demand {{application}}", "carpool:autoscaler_demand"),
      ("waiting {{application}}", "carpool:autoscaler_requests_waiting")], "timeseries"),
    ("Autoscaling: queue wait (policy input)",
     "Head-of-queue wait for a seat, 90th percentile of the look-back window's samples, worst replica.", "s",
     [("{{application}}", "carpool:autoscaler_queue_wait_seconds")], "timeseries"),
    ("Autoscaling: scaling decisions",
     "Changes of the target replica count, up and down.", "short",
     [("{{direction}}", f"sum by (direction) (increase(carpool:autoscaler_decisions_total[{RATE}]))")], "timeseries"),
]


def row(i: int, title: str, y: int) -> dict:
    """A row header across the dashboard: the panels after it, up to the next row, are its own."""
    return {"id": i + 1, "type": ROW, "title": title, "collapsed": False, "panels": [],
            "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}}


def panel(i: int, title: str, description: str, unit: str, targets, kind: str, x: int, y: int) -> dict:
    return {
        "id": i + 1,
        "type": kind,
        "title": title,
        "description": description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit, "min": 0}, "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]}},
        "targets": [
            {"refId": chr(ord("A") + j), "expr": expr, "legendFormat": legend,
             "datasource": {"type": "prometheus", "uid": "${datasource}"}}
            for j, (legend, expr) in enumerate(targets)
        ],
    }


def layout() -> list[dict]:
    """Every panel, two per line (8 units high); a row takes a line of its own (1 unit)."""
    out, y, column = [], 0, 0
    for i, (title, description, unit, targets, kind) in enumerate(PANELS):
        if kind == ROW:
            y += 8 if column else 0
            out.append(row(i, title, y))
            y, column = y + 1, 0
            continue
        out.append(panel(i, title, description, unit, targets, kind, 12 * column, y))
        column = 1 - column
        y += 8 if column == 0 else 0
    return out


def dashboard() -> dict:
    return {
        "title": "Carpool",
        "uid": "carpool-serving",
        "description": "Carpool LLM serving: seats, queues, KV cache, throughput and latency per replica.",
        "tags": ["carpool", "llm", "serving"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "templating": {
            "list": [
                {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
                 "current": {}, "hide": 0},
                {"name": "model", "label": "Model", "type": "query",
                 "datasource": {"type": "prometheus", "uid": "${datasource}"},
                 "query": {"query": "label_values(carpool:num_slots, model_name)", "refId": "model"},
                 "definition": "label_values(carpool:num_slots, model_name)",
                 "includeAll": True, "multi": True, "allValue": ".*", "refresh": 2, "current": {}},
                {"name": "replica", "label": "Replica", "type": "query",
                 "datasource": {"type": "prometheus", "uid": "${datasource}"},
                 "query": {"query": 'label_values(carpool:num_slots{model_name=~"$model"}, replica)', "refId": "replica"},
                 "definition": 'label_values(carpool:num_slots{model_name=~"$model"}, replica)',
                 "includeAll": True, "multi": True, "allValue": ".*", "refresh": 2, "current": {}},
            ]
        },
        "panels": layout(),
    }


if __name__ == "__main__":
    out = Path(__file__).with_name("carpool.json")
    out.write_text(json.dumps(dashboard(), indent=2) + "\n")
    print(f"wrote {out} ({sum(p[4] != ROW for p in PANELS)} panels)")
