"""Speculative decoding in the benchmarks: how many drafted tokens were accepted.

* Offline (``carpool bench offline``/``profile`` with ``--speculative-config``): the engine's
  counters since start (``LLMEngine.spec_decode_stats``, a
  :class:`replica.engine.stats.SpecDecodeStats`), read with :func:`engine_counters`;
  :func:`counters_delta` is what one run added (each policy's run, without the warm-up).
* Served (``carpool bench serve``): the counters ``carpool:spec_decode_num_drafts_total``,
  ``..._num_draft_tokens_total`` and ``..._num_accepted_tokens_total`` of each replica in the
  server's ``/metrics``, scraped before and after the run (:func:`parse_spec_decode_counters`,
  :func:`served_deltas`); None when the server exports none, or has drafted nothing since it
  started (replicas export them at 0 without speculation).

Both report vLLM's two numbers: ``acceptance_rate`` = accepted ÷ drafted tokens and
``mean_acceptance_length`` = 1 + accepted ÷ drafts (tokens a verified row emits on average; a
draft is one request's proposal in one step).
"""

from __future__ import annotations

COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def with_rates(counters: dict) -> dict:
    """``counters`` (``num_drafts``, ``num_draft_tokens``, ``num_accepted_tokens``, maybe more) plus
    ``acceptance_rate`` and ``mean_acceptance_length`` (None with no drafts)."""
    drafts, drafted, accepted = (counters[k] for k in COUNTERS)
    return {
        **counters,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
    }


def engine_counters(engine) -> dict | None:
    """The engine's speculative decoding counters since start (``SpecDecodeStats.as_dict()``), or
    None for an engine without them."""
    stats = getattr(engine, "spec_decode_stats", None)
    return stats.as_dict() if stats is not None else None


def counters_delta(before: dict | None, after: dict | None) -> dict | None:
    """What ran between two :func:`engine_counters` snapshots: the counters' and
    ``accepted_per_position``'s differences, with the rates of that stretch alone."""
    if before is None or after is None:
        return None
    delta = {k: after[k] - before[k] for k in COUNTERS}
    old = list(before.get("accepted_per_position", []))
    new = list(after.get("accepted_per_position", []))
    old += [0] * (len(new) - len(old))
    delta["accepted_per_position"] = [n - o for n, o in zip(new, old)]
    return with_rates(delta)


def parse_spec_decode_counters(text: str) -> dict[str, dict[str, float]]:
    """``{replica: {"num_drafts", "num_draft_tokens", "num_accepted_tokens"}}`` from a Prometheus
    exposition text (``{}`` when it has none of the counters)."""
    from prometheus_client.parser import text_string_to_metric_families

    names = {f"carpool:spec_decode_{k}_total": k for k in COUNTERS}
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            kind = names.get(sample.name)
            if kind is not None:
                replica = sample.labels.get("replica", "")
                out.setdefault(replica, {k: 0.0 for k in COUNTERS})[kind] += sample.value
    return out


def served_deltas(before: str | None, after: str | None) -> dict | None:
    """The run's counters from two scrapes of ``/metrics`` (texts; None: the scrape failed): the
    totals over the replicas seen in both, with rates, and ``replicas`` (each one's own); None
    when a scrape failed, or the server exports no speculative decoding counters or has them all
    at 0 (it does not speculate)."""
    if before is None or after is None:
        return None
    first, last = parse_spec_decode_counters(before), parse_spec_decode_counters(after)
    if not any(value for counters in last.values() for value in counters.values()):
        return None
    replicas = {
        name: with_rates({k: int(last[name][k] - first[name][k]) for k in COUNTERS})
        for name in sorted(set(first) & set(last))
    }
    if not replicas:
        return None
    totals = {k: sum(r[k] for r in replicas.values()) for k in COUNTERS}
    return {**with_rates(totals), "replicas": replicas}


def format_spec_decode(stats: dict, label: str = "spec decode") -> str:
    """One line: ``spec decode: acceptance 61.2% (1234 of 2016 draft tokens), mean acceptance
    length 2.76 (700 drafts)``."""
    rate, length = stats.get("acceptance_rate"), stats.get("mean_acceptance_length")
    return (
        f"{label}: acceptance {'-' if rate is None else f'{rate:.1%}'} ({stats['num_accepted_tokens']} of "
        f"{stats['num_draft_tokens']} draft tokens), mean acceptance length "
        f"{'-' if length is None else f'{length:.2f}'} ({stats['num_drafts']} drafts)"
    )
