"""Prefix caching seen from ``carpool bench serve``: the served multi-turn workload, the hit rate
read from the server's ``/metrics``, and the best hit rate the workload allows.

* :func:`run_conversation`: one conversation of the ``multi-turn`` workload
  (:mod:`cluster.bench.workloads.prefix`) as streamed chat completions: each turn sends the whole
  chat so far, the real assistant replies included, plus a follow-up question; the next turn is
  sent when the previous one has ended (plus a think time). Conversations run concurrently.
* :func:`scrape_metrics`: the text of one scrape of ``/metrics``.
* :func:`read_prefix_cache_counters`: ``carpool:prefix_cache_queries_total`` and
  ``carpool:prefix_cache_hits_total`` per replica, from one scrape of ``/metrics``; the bench
  scrapes before and after the run and reports the deltas (:func:`counter_deltas`), so the hit
  rate is over this run's requests (and whatever else the server did meanwhile).
* :func:`best_hit_rate`: the prompts as the ingress tokenizes them (the chat template rendered as
  text, then encoded), in the order they were sent, through one unbounded cache of block hashes:
  each prompt is looked up, then its tokens and its reply's (re-encoded) are inserted. A reply
  resent in the next turn is text, and the server tokenizes it again: where that differs from the
  ids the model generated, no engine can reuse those blocks, so a measured rate below this bound
  comes from that, from evictions, or from turns routed to a replica that does not hold them.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from cluster.bench.workloads import prefix as pw

COUNTERS = ("queries", "hits")


@dataclass
class SentTurn:
    """What the bench sent for one turn and what came back (for :func:`best_hit_rate`)."""

    sent_at: float
    messages: list[dict]
    reply: str = ""
    ok: bool = False


@dataclass
class ConversationLog:
    turns: list[SentTurn] = field(default_factory=list)


def metrics_url_of(url: str) -> str:
    """``/metrics`` at the root of the API's base URL (``http://h:p/v1`` → ``http://h:p/metrics``)."""
    base = url.rstrip("/")
    if base.endswith("/v1"):
        base = base[: -len("/v1")]
    return base + "/metrics"


def parse_prefix_cache_counters(text: str) -> dict[str, dict[str, float]]:
    """``{replica: {"queries": float, "hits": float}}`` from a Prometheus exposition text."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for kind in COUNTERS:
                if sample.name == f"carpool:prefix_cache_{kind}_total":
                    replica = sample.labels.get("replica", "")
                    out.setdefault(replica, {k: 0.0 for k in COUNTERS})[kind] += sample.value
    return out


async def scrape_metrics(metrics_url: str, api_key: str | None = None, timeout: float = 30.0) -> str | None:
    """One scrape of ``metrics_url``: its Prometheus text, or None if it cannot be read."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(timeout=timeout) as http:
            response = await http.get(metrics_url, headers=headers)
            response.raise_for_status()
    except Exception:  # noqa: BLE001 - no metrics is reported as such, not a failed bench
        return None
    return response.text


async def read_prefix_cache_counters(metrics_url: str, api_key: str | None = None, timeout: float = 30.0) -> dict | None:
    """One scrape of ``metrics_url``: per-replica counters, or None if it cannot be read."""
    text = await scrape_metrics(metrics_url, api_key, timeout)
    return None if text is None else parse_prefix_cache_counters(text)


def counter_deltas(before: dict | None, after: dict | None) -> dict | None:
    """The run's hits and queries (tokens), summed over the replicas seen in both scrapes, with
    each replica's own; None when a scrape failed or the server exports no such counters."""
    if before is None or after is None:
        return None
    replicas = {}
    for replica in sorted(set(before) & set(after)):
        q = after[replica]["queries"] - before[replica]["queries"]
        h = after[replica]["hits"] - before[replica]["hits"]
        replicas[replica] = {"queries": int(q), "hits": int(h), "hit_rate": h / q if q else None}
    if not replicas:
        return None
    queries = sum(r["queries"] for r in replicas.values())
    hits = sum(r["hits"] for r in replicas.values())
    return {"queries": queries, "hits": hits, "hit_rate": hits / queries if queries else None, "replicas": replicas}


def load_tokenizer(name: str):
    """The tokenizer the ingress uses for ``name`` (a hub id or a folder; no weights fetched)."""
    from replica.config.model_files import load_tokenizer as load
    from replica.config.model_files import resolve_model_path

    return load(resolve_model_path(name, weights=False))


def opening_messages(tokenizer, num_conversations: int, first_turn_len: int) -> list[list[dict]]:
    """Each conversation's first chat: one user message (its passage and the opening question)."""
    return [[{"role": "user", "content": pw.opening_message(tokenizer, c, first_turn_len)}] for c in range(num_conversations)]


async def run_conversation(
    send, conversation: int, messages: list[dict], num_turns: int, log: ConversationLog, think_time: float = 0.0
) -> None:
    """Send the turns of one conversation one after the other, ``think_time`` s apart (from the end
    of a reply to the next turn).

    ``send(turn, messages) -> (ok, reply_text)`` streams one chat completion (and records its
    measurements). A failed turn ends the conversation (its later turns are not sent).
    """
    chat = list(messages)
    for turn in range(1, num_turns + 1):
        if turn > 1:
            if think_time > 0:
                await asyncio.sleep(think_time)
            chat = chat + [{"role": "user", "content": pw.follow_up(conversation, turn)}]
        sent = SentTurn(sent_at=time.perf_counter(), messages=chat)
        log.turns.append(sent)
        sent.ok, sent.reply = await send(turn, chat)
        if not sent.ok:
            return
        chat = chat + [{"role": "assistant", "content": sent.reply}]


def best_hit_rate(tokenizer, logs: list[ConversationLog], block_size: int = 16) -> dict:
    """The best hit rate of the turns sent (see the module docstring): ``{"queries", "hits", "hit_rate"}``."""
    sent = sorted((t for log in logs for t in log.turns), key=lambda t: t.sent_at)
    events = []
    for t in sent:
        prompt = pw.render_ids(tokenizer, t.messages)
        reply = list(tokenizer.encode(t.reply, add_special_tokens=False)) if t.ok else []
        events.append((prompt, prompt + reply[:-1]))
    return pw.simulate_prefix_cache(events, block_size)


def format_prefix_cache(cache: dict) -> list[str]:
    """The table lines of a run's prefix-cache counters (``summary["prefix_cache"]``)."""

    def pct(v):
        return "-" if v is None else f"{v:.1%}"

    best = cache.get("best") or {}
    lines = [f"prefix cache: hit rate {pct(cache['hit_rate'])} ({cache['hits']} of {cache['queries']} prompt tokens), "
             f"best possible {pct(best.get('hit_rate'))}"]
    if len(cache["replicas"]) > 1:
        lines.append("  per replica: " + ", ".join(
            f"{name}: {pct(r['hit_rate'])} of {r['queries']}" for name, r in cache["replicas"].items()))
    return lines
