"""The results of ``carpool bench serve`` (:mod:`cluster.bench.serving.serve`): the summary dict (the
JSON written by ``--json``) from the per-request measurements, and the table printed from it.
"""

from __future__ import annotations

import math
import statistics

from cluster.bench.engine import spec_decode as sd

MAX_ERROR_MESSAGES = 5
PERCENTILES = (50, 90, 99)


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values`` by linear interpolation (numpy's default)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize_ms(values_s: list[float]) -> dict:
    """``{"mean", "p50", "p90", "p99"}`` in milliseconds of values in seconds (None when empty)."""
    if not values_s:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    ms = [v * 1000 for v in values_s]
    return {"mean": statistics.fmean(ms), **{f"p{q}": percentile(ms, q) for q in PERCENTILES}}


def summarize(results: list, duration_s: float, **settings) -> dict:  # results: cluster.bench.serving.serve.RequestResult
    """The results dict: settings, counts, throughput, latency summaries (ms), errors, per request.

    Fields: ``url, model, num_prompts, request_rate`` (requests/s; ``"inf"`` for all at once),
    ``workload, seed, priority, max_concurrency, timeout_s, duration_s, completed, errors, error_messages``
    (the first few), ``requested_output_tokens`` (sum of max_tokens), ``output_tokens`` (sum of
    usage over completed requests), ``requests_per_s, output_tokens_per_s, ttft_ms, itl_ms, e2e_ms``
    (each ``{mean, p50, p90, p99}``), ``prefix_cache`` and ``requests`` (per request: index,
    max_tokens, ok, output_tokens, ttft_ms, e2e_ms, error; multi-turn adds conversation and turn).
    ``prefix_cache``: None when the server's ``/metrics`` has no prefix cache counters, else the
    run's ``queries`` and ``hits`` (tokens, summed over replicas), ``hit_rate``, ``replicas`` (the
    same per replica), ``best`` (``{queries, hits, hit_rate}`` of one unbounded cache over the sent
    prompts, None without a tokenizer) and ``metrics_url``. ``spec_decode``: None when ``/metrics``
    has no speculative decoding counters or they are all 0 (no speculation), else the run's ``num_drafts``, ``num_draft_tokens``,
    ``num_accepted_tokens`` (summed over replicas), ``acceptance_rate`` (accepted ÷ draft tokens),
    ``mean_acceptance_length`` (1 + accepted ÷ drafts) and ``replicas`` (the same per replica).
    ``slo``: None without latency targets, else :func:`slo_outcomes`. Multi-turn adds ``conversations``,
    ``turns``, ``first_turn_len`` and ``think_time_s``.
    """
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok and r.shed_s is None]
    output_tokens = sum(r.output_tokens for r in ok)
    rate = settings.pop("request_rate")
    timeout = settings.pop("timeout")
    multi_turn = {k: settings[k] for k in ("conversations", "turns", "first_turn_len", "think_time_s") if k in settings}
    return {
        "url": settings["url"],
        "model": settings["model"],
        "num_prompts": len(results),
        "request_rate": "inf" if math.isinf(rate) else rate,
        "workload": settings["workload"],
        "seed": settings["seed"],
        "priority": settings.get("priority", 0),
        "max_concurrency": settings["max_concurrency"],
        "timeout_s": timeout,
        "duration_s": duration_s,
        "completed": len(ok),
        "errors": len(failed),
        "error_messages": [f"request {r.index}: {r.error or 'not run'}" for r in failed[:MAX_ERROR_MESSAGES]],
        "requested_output_tokens": sum(r.max_tokens for r in results),
        "output_tokens": output_tokens,
        "requests_per_s": len(ok) / duration_s if duration_s > 0 else 0.0,
        "output_tokens_per_s": output_tokens / duration_s if duration_s > 0 else 0.0,
        "ttft_ms": summarize_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_ms": summarize_ms([gap for r in ok for gap in r.itl_s]),
        "e2e_ms": summarize_ms([r.e2e_s for r in ok]),
        **multi_turn,
        "prefix_cache": settings.get("prefix_cache"),
        "spec_decode": settings.get("spec_decode"),
        "slo": slo_outcomes(results, settings["slo"], len(failed)) if settings.get("slo") else None,
        "requests": [
            {
                "index": r.index, "max_tokens": r.max_tokens, "ok": r.ok, "output_tokens": r.output_tokens,
                "ttft_ms": None if r.ttft_s is None else r.ttft_s * 1000,
                "e2e_ms": None if r.e2e_s is None else r.e2e_s * 1000,
                "error": r.error,
                **({"shed_ms": r.shed_s * 1000} if r.shed_s is not None else {}),
                **({"conversation": r.conversation, "turn": r.turn} if r.conversation is not None else {}),
            }
            for r in results
        ],
    }


def slo_outcomes(results: list, targets: dict, failed: int) -> dict:
    """The requests' outcomes against their latency ``targets`` (``{"ttft_ms", "tpot_ms", "shed"}``,
    None: no target), as measured by the client: ``met`` (completed, TTFT and mean time per
    output token after the first within their targets), ``missed`` (completed late), ``shed``
    (answered 429 ``slo_unattainable``), ``failed`` (anything else; :func:`summarize` counts
    them), and the shed answers' latency from sending (``shed_ms``: ``{mean, p50, p90, p99}``
    and ``max``)."""
    ttft, tpot = targets.get("ttft_ms"), targets.get("tpot_ms")

    def on_time(r) -> bool:
        if ttft is not None and (r.ttft_s is None or r.ttft_s * 1000 > ttft):
            return False
        gaps = r.output_tokens - 1
        return tpot is None or gaps < 1 or r.ttft_s is None or (r.e2e_s - r.ttft_s) / gaps * 1000 <= tpot

    done = [r for r in results if r.ok]
    shed = [r.shed_s for r in results if r.shed_s is not None]
    met = sum(on_time(r) for r in done)
    return {
        **targets, "met": met, "missed": len(done) - met, "shed": len(shed),
        "failed": failed,
        "shed_ms": {**summarize_ms(shed), "max": max(shed) * 1000 if shed else None},
    }


def format_table(summary: dict) -> str:
    """The results as a plain-text table (the stdout of ``carpool bench serve``)."""
    def num(v, fmt="{:.1f}"):
        return "-" if v is None else fmt.format(v)

    lines = [
        f"model: {summary['model']}  url: {summary['url']}",
        f"requests: {summary['num_prompts']}"
        + (f" ({summary['conversations']} conversations x {summary['turns']} turns, think time {summary['think_time_s']} s)"
           if "turns" in summary else "")
        + f"  rate: {summary['request_rate']} req/s  "
        f"max concurrency: {summary['max_concurrency'] or '-'}  workload: {summary['workload']}"
        + (f"  priority: {summary['priority']}" if summary.get("priority") else ""),
        f"completed: {summary['completed']}  errors: {summary['errors']}  duration: {summary['duration_s']:.2f} s",
        f"output tokens: {summary['output_tokens']} (requested {summary['requested_output_tokens']})",
        f"throughput: {summary['requests_per_s']:.2f} req/s, {summary['output_tokens_per_s']:.1f} output tok/s",
        "",
        f"{'metric (ms)':<12}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for name, key in (("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("e2e", "e2e_ms")):
        s = summary[key]
        lines.append(f"{name:<12}" + "".join(f"{num(s[k]):>10}" for k in ("mean", "p50", "p90", "p99")))
    if summary.get("prefix_cache") is not None:
        from cluster.bench.serving.serve_prefix import format_prefix_cache

        lines += ["", *format_prefix_cache(summary["prefix_cache"])]
    if summary.get("spec_decode") is not None:  # under the prefix cache's lines, or after a blank line
        lines += ([] if summary.get("prefix_cache") is not None else [""]) + [sd.format_spec_decode(summary["spec_decode"])]
    slo = summary.get("slo")
    if slo is not None:
        lines += ["", f"latency targets: TTFT {num(slo['ttft_ms'], '{:g}')} ms, TPOT {num(slo['tpot_ms'], '{:g}')} ms, "
                      f"shed {'asked' if slo['shed'] else 'not asked'}",
                  f"met: {slo['met']}  missed: {slo['missed']}  shed: {slo['shed']}  failed: {slo['failed']}  "
                  f"shed answered in p50 {num(slo['shed_ms']['p50'])} ms, p99 {num(slo['shed_ms']['p99'])} ms, "
                  f"max {num(slo['shed_ms']['max'])} ms"]
    if summary["error_messages"]:
        lines += ["", "first errors:"] + [f"  {m}" for m in summary["error_messages"]]
    return "\n".join(lines)
