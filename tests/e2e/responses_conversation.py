"""A three-turn Responses-API conversation by ``previous_response_id`` on the 2-node app of
``tests/e2e/test_prefix_routing.py`` (run inside its script, on its cache-aware app, after its chat
workload): what the issue asks of follow-ups, measured there.

Per turn, streamed through the ``openai`` client: the time to the first text delta, and the prefix
cache's queries and hits on each replica before and after (the turns run one at a time, so the
differences are the turn's own). Then the third turn's history is sent whole (explicit items,
not stored) behind other instructions, so that no replica holds any of its blocks: its time to
first token is the cold baseline. Last, the replica that served the conversation is killed and
the stored responses are read back (they live in the ``ResponseStore`` deployment).
"""

from __future__ import annotations

import time

INSTRUCTIONS = "You answer questions about rail journeys in Europe. Keep answers short."
FOLLOW_UPS = ["Which leg is the most expensive?", "And which one leaves earliest?"]
MAX_OUTPUT_TOKENS = 16


def _stats(actors) -> list[dict]:
    import ray

    return ray.get([a.record_routing_stats.remote() for a in actors], timeout=30)


def _streamed(client, **fields) -> tuple[float, object]:
    """``(seconds to the first text delta, the final response)`` of one streamed response."""
    started = time.monotonic()
    first = None
    final = None
    for event in client.responses.create(stream=True, temperature=0, max_output_tokens=MAX_OUTPUT_TOKENS, **fields):
        if event.type == "response.output_text.delta" and first is None:
            first = time.monotonic() - started
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    return first, final


def run(base_url: str, model: str, actors, opening: str, idle) -> dict:
    """The conversation, the cold baseline and the replica kill; returns what the test asserts on.
    ``idle(actors)`` checks that every replica is idle with every KV block free (before the kill)."""
    import openai
    import ray

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    turns = []
    previous = None
    inputs = [opening, *FOLLOW_UPS]
    for text in inputs:
        before = _stats(actors)
        ttft, response = _streamed(client, model=model, instructions=INSTRUCTIONS, input=text,
                                   **({"previous_response_id": previous.id} if previous else {}))
        after = _stats(actors)
        turns.append({
            "id": response.id, "ttft_s": ttft, "input_tokens": response.usage.input_tokens,
            "output_tokens": response.usage.output_tokens, "text": response.output_text,
            "cached_tokens": response.usage.input_tokens_details.cached_tokens,
            "queries": sum(a["prefix_cache_queries"] - b["prefix_cache_queries"] for a, b in zip(after, before)),
            "hits": sum(a["prefix_cache_hits"] - b["prefix_cache_hits"] for a, b in zip(after, before)),
            "served_by": [a["num_requests"] - b["num_requests"] for a, b in zip(after, before)],
        })
        previous = response
    # The whole history of the third turn, sent whole where no replica holds any of it.
    items = []
    for turn, text in zip(turns[:-1], inputs):
        items += [{"role": "user", "content": text}, {"role": "assistant", "content": turn["text"]}]
    items.append({"role": "user", "content": inputs[-1]})
    cold = []
    for nonce in ("Reply as a rail clerk would.", "Reply as a ticket office would."):
        ttft, response = _streamed(client, model=model, instructions=nonce + " " + INSTRUCTIONS, input=items, store=False)
        cold.append({"ttft_s": ttft, "input_tokens": response.usage.input_tokens})
    idle(actors)
    server = max(range(len(actors)), key=lambda i: turns[-1]["served_by"][i])
    ray.kill(actors[server])
    stored = [client.responses.retrieve(t["id"]) for t in turns]
    return {
        "turns": turns,
        "cold": cold,
        "killed_replica": server,
        "stored_after_kill": [{"id": r.id, "text": r.output_text} for r in stored],
    }
