"""Benchmark workloads: which requests arrive when, and how many output tokens each generates.

Every workload is a list of :class:`BenchRequest`. Output lengths are exact (the engine runs them
with ``ignore_eos``), so both policies, and transformers, generate the same tokens. A request with
``arrival_step=k`` is added to the engine after the run's ``k``-th step (0: before the first step).

* ``seed-example``: the article's five requests on 4 seats, A 100, B 20, C 50, D 200 output tokens
  at the start and E (30) right after the first step.
* ``seed-mix``: ``num_requests`` requests, even indices ``short`` (20) and odd ones ``long`` (200).
* ``sweep``: output lengths from an exponential distribution of mean ``mean_tokens``, capped at each
  of ``caps``; the higher the cap, the more the lengths vary (see :func:`sweep_lengths`).
* ``input-grounded`` (:mod:`cluster.bench.workloads.input_grounded`): prompts holding a paragraph or a
  Python function that the answer repeats or edits (for speculative decoding by prompt lookup);
  128 to 200 output tokens, drawn from ``seed``.
* a JSONL file: one ``{"prompt": ..., "max_tokens": ...}`` object per line (``id`` optional;
  ``prompt`` may be a string or a list of token ids).
"""

from __future__ import annotations

import json
import math
import random
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten-year-old.",
    "List some tips for learning a new programming language.",
    "What are the main causes of the seasons on Earth?",
    "Describe the water cycle.",
    "Give me a recipe for a simple tomato soup.",
    "Why is the sky blue?",
    "Summarize the plot of a heist movie you invent.",
    "How do vaccines train the immune system?",
    "Compare trains and planes for a 500 km trip.",
]

# The article's worked example: (id, output tokens, arrival step) and where each request finishes.
SEED_EXAMPLE = [("A", 100, 0), ("B", 20, 0), ("C", 50, 0), ("D", 200, 0), ("E", 30, 1)]
SEED_EXAMPLE_SEATS = 4
SEED_EXAMPLE_FINISH_STEPS = {
    # Continuous: E takes B's seat at step 21 and generates its 30 tokens in steps 21..50.
    "continuous": {"A": 100, "B": 20, "C": 50, "D": 200, "E": 50},
    # Static: E waits for the whole first batch (D ends at step 200) and runs in steps 201..230.
    "static": {"A": 100, "B": 20, "C": 50, "D": 200, "E": 230},
}

BUILTIN_WORKLOADS = ("seed-example", "seed-mix", "sweep", "input-grounded")


@dataclass
class BenchRequest:
    """One request of a workload: a text prompt or token ids, exact output length, arrival step."""

    id: str
    max_tokens: int
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    arrival_step: int = 0
    prompt_logprobs: int | None = None  # also score the prompt (SamplingParams.prompt_logprobs)
    structured_outputs: Any = None  # a constraint on the output (SamplingParams.structured_outputs)


ENDLESS_JSON = {
    "type": "array",
    "minItems": 100000,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "name": {"type": "string", "maxLength": 16},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
            "score": {"type": "number"},
        },
        "required": ["id", "name", "tags", "score"],
        "additionalProperties": False,
    },
}
"""A JSON schema no output completes within any ``max_tokens`` here (an array of at least 100,000
objects with strings, enums and numbers): a request constrained by it generates exactly as many
tokens as an unconstrained one, so two runs that differ only in constraints do the same work
apart from the masks."""


def seed_example() -> list[BenchRequest]:
    return [
        BenchRequest(id=rid, max_tokens=n, prompt=PROMPTS[i], arrival_step=arrival)
        for i, (rid, n, arrival) in enumerate(SEED_EXAMPLE)
    ]


def seed_mix(num_requests: int = 100, short: int = 20, long: int = 200) -> list[BenchRequest]:
    """``num_requests`` requests, all at the start: even indices ``short`` tokens, odd ones ``long``."""
    return [
        BenchRequest(id=str(i), max_tokens=short if i % 2 == 0 else long, prompt=PROMPTS[i % len(PROMPTS)])
        for i in range(num_requests)
    ]


def sweep_lengths(num_requests: int, mean_tokens: float, cap: int, seed: int = 0) -> list[int]:
    """``num_requests`` lengths ``min(cap, ceil(Exp(mean_tokens)))`` (at least 1), reproducible by ``seed``.

    The same draws are used for every cap, so a higher cap only lengthens the tail: at cap 32 most
    requests hit the cap (little variance), at cap 512 the whole exponential tail is kept.
    """
    rng = random.Random(seed)
    draws = [rng.expovariate(1.0 / mean_tokens) for _ in range(num_requests)]
    return [max(1, min(cap, math.ceil(x))) for x in draws]


def sweep(num_requests: int, mean_tokens: float, cap: int, seed: int = 0) -> list[BenchRequest]:
    lengths = sweep_lengths(num_requests, mean_tokens, cap, seed)
    return [
        BenchRequest(id=str(i), max_tokens=n, prompt=PROMPTS[i % len(PROMPTS)]) for i, n in enumerate(lengths)
    ]


def coefficient_of_variation(lengths: list[int]) -> float:
    """Standard deviation ÷ mean of the output lengths (0 when they are all equal)."""
    mean = statistics.fmean(lengths)
    return statistics.pstdev(lengths) / mean if mean else 0.0


def read_jsonl(path: str | Path) -> list[BenchRequest]:
    """Requests from a JSONL file of ``{"prompt": str | [int, ...], "max_tokens": int, "id"?: str}``.

    All arrive at the start. Blank lines are skipped. Raises ``ValueError`` naming the line for
    invalid JSON, a missing or empty ``prompt``, a ``max_tokens`` that is not a positive integer,
    or a repeated ``id``.
    """
    path = Path(path)
    requests: list[BenchRequest] = []
    seen: set[str] = set()
    with path.open() as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
            if not isinstance(item, dict):
                raise ValueError(f"{where}: expected an object with prompt and max_tokens")
            prompt = item.get("prompt")
            max_tokens = item.get("max_tokens")
            if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
                raise ValueError(f"{where}: max_tokens must be a positive integer, got {max_tokens!r}")
            rid = str(item.get("id", len(requests)))
            if rid in seen:
                raise ValueError(f"{where}: id {rid!r} is used twice")
            seen.add(rid)
            if isinstance(prompt, str) and prompt:
                requests.append(BenchRequest(id=rid, max_tokens=max_tokens, prompt=prompt))
            elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                requests.append(BenchRequest(id=rid, max_tokens=max_tokens, prompt_token_ids=list(prompt)))
            else:
                raise ValueError(f"{where}: prompt must be a non-empty string or list of token ids, got {prompt!r}")
    if not requests:
        raise ValueError(f"{path}: no requests")
    return requests


def tokenize(requests: list[BenchRequest], tokenizer, *, chat_template: bool = True) -> None:
    """Fill in ``prompt_token_ids`` of text prompts, in place.

    With ``chat_template`` (and a tokenizer that has one) the prompt becomes one user message with
    the assistant turn opened, as the chat API would send it; otherwise it is encoded as is.
    """
    use_chat = chat_template and getattr(tokenizer, "chat_template", None)
    for request in requests:
        if request.prompt_token_ids is not None:
            continue
        if use_chat:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": request.prompt}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        else:
            ids = tokenizer.encode(request.prompt, add_special_tokens=True)
        request.prompt_token_ids = list(ids)
