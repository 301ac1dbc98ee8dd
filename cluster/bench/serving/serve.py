"""``carpool bench serve``: a load generator against a running OpenAI-compatible server.

Like ``vllm bench serve``: ``num_prompts`` streaming chat completions are sent to ``--url`` with the
real ``openai`` client (``AsyncOpenAI``), arriving as a Poisson process at ``request_rate``
requests/s (exponential inter-arrival gaps drawn from ``seed``), or all at once when the rate is
``inf``. Every request asks for exactly ``max_tokens`` output tokens (``ignore_eos``) and
``stream_options={"include_usage": True}``. Per request it measures:

* TTFT (s): from sending the request to its first chunk with non-empty content;
* ITL (s): the gaps between consecutive content chunks (one per chunk gap, pooled over requests);
* e2e latency (s): from sending the request to the end of its stream;
* output tokens: ``usage.completion_tokens`` of the final chunk.

It reports throughput (completed requests/s and output tokens/s over the run's wall time), the
mean, p50, p90 and p99 of TTFT, ITL and e2e (in milliseconds), and the errors (count and the first
messages). The run is bounded by ``num_prompts`` and by ``timeout`` seconds: requests not done by
then are cancelled and counted as errors. :func:`run_serve_bench` returns the results as a dict
(the JSON written by ``--json``); :func:`serve_main` also prints a table.

The ``multi-turn`` workload sends conversations instead (:mod:`cluster.bench.serving.serve_prefix`): each
turn resends the chat so far with the real replies, the next turn goes when the previous one has
ended, and the conversations run concurrently. With every workload the bench scrapes the server's
``/metrics`` before and after the run and reports the prefix cache's hit rate over the run, with
the best rate the sent prompts allow, and, when the server speculates (its ``/metrics`` has the
``carpool:spec_decode_*`` counters), the drafts' acceptance rate and mean acceptance length over
the run (:mod:`cluster.bench.engine.spec_decode`). The summary and the table are built by
:mod:`cluster.bench.serving.serve_report`.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from cluster.bench.engine import spec_decode as sd
from cluster.bench.serving.serve_report import format_table, summarize
from cluster.bench.workloads import base as workloads
from cluster.bench.workloads.input_grounded import input_grounded

@dataclass
class RequestResult:
    """What one request measured. Times in seconds; ``ok`` False means it failed or was cancelled."""

    index: int
    max_tokens: int
    ok: bool = False
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None
    conversation: int | None = None  # multi-turn: which conversation, which turn (from 1)
    turn: int | None = None
    shed_s: float | None = None  # refused with 429 slo_unattainable (asked with --shed): seconds to that answer


def bench_prompts(
    workload: str = "seed-mix", num_prompts: int = 100, *, short: int = 20, long: int = 200, max_tokens: int | None = None,
    seed: int = 0,
) -> list[tuple[str, int]]:
    """``num_prompts`` (prompt, max_tokens) pairs.

    ``seed-mix``: even indices ``short`` output tokens, odd ones ``long`` (the offline bench's mix).
    ``input-grounded``: prompts whose answer repeats or edits a document they hold
    (:mod:`cluster.bench.workloads.input_grounded`, drawn from ``seed``). Otherwise ``workload`` is a JSONL file of ``{"prompt": str, "max_tokens": int}`` (see
    :func:`cluster.bench.workloads.base.read_jsonl`; text prompts only), cycled or cut to ``num_prompts``.
    ``max_tokens``, when given, replaces every request's output length. Raises ``ValueError``.
    """
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be at least 1, got {num_prompts}")
    if workload == "seed-mix":
        requests = workloads.seed_mix(num_prompts, short, long)
    elif workload == "input-grounded":
        requests = input_grounded(num_prompts, seed)
    elif Path(workload).is_file():
        requests = workloads.read_jsonl(workload)
        if any(r.prompt is None for r in requests):
            raise ValueError(f"{workload}: bench serve sends chat messages; prompts must be text, not token ids")
        requests = [requests[i % len(requests)] for i in range(num_prompts)]
    else:
        raise ValueError(f"--workload must be seed-mix, input-grounded, multi-turn or a JSONL file, got {workload!r}")
    if max_tokens is not None:
        if max_tokens < 1:
            raise ValueError(f"--max-tokens must be at least 1, got {max_tokens}")
        return [(r.prompt, max_tokens) for r in requests]
    return [(r.prompt, r.max_tokens) for r in requests]


def arrival_offsets(num_prompts: int, request_rate: float, seed: int = 0) -> list[float]:
    """Send times (s after the start) of a Poisson process of ``request_rate`` requests/s.

    The first request goes at 0, then exponential gaps of mean ``1 / request_rate`` s drawn from
    ``random.Random(seed)``. ``inf`` rate: all at 0.
    """
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be positive (or inf), got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * num_prompts
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for i in range(num_prompts):
        if i:
            t += rng.expovariate(request_rate)
        offsets.append(t)
    return offsets


def slo_headers(slo_ttft_ms: float | None, slo_tpot_ms: float | None, shed: bool) -> dict[str, str]:
    """The latency-target headers of every request (docs/serving.md, "Latency targets and
    shedding"). Raises ``ValueError`` for ``shed`` without a TTFT target."""
    if shed and slo_ttft_ms is None:
        raise ValueError("--shed needs --slo-ttft-ms (the target a request is shed against)")
    headers = {}
    if slo_ttft_ms is not None:
        headers["x-slo-ttft-ms"] = f"{slo_ttft_ms:g}"
    if slo_tpot_ms is not None:
        headers["x-slo-tpot-ms"] = f"{slo_tpot_ms:g}"
    if shed:
        headers["x-slo-shed"] = "true"
    return headers


async def _one_request(
    client, model: str, index: int, prompt: str | list[dict], max_tokens: int, result: RequestResult,
    headers: dict[str, str] | None = None, priority: int = 0,
) -> str:
    """Stream one chat completion, filling ``result`` in place (so a cancelled request keeps its
    index); ``prompt`` is one user message's text or the whole chat; ``headers`` go with it, and
    ``priority`` in its body when not 0.
    Returns the reply's text. A 429 ``slo_unattainable`` (the request asked to be shed) sets
    ``result.shed_s`` instead of raising."""
    import openai

    start = time.perf_counter()
    last = None
    reply: list[str] = []
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt,
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, **({"priority": priority} if priority else {})},
            extra_headers=headers or None,
        )
    except openai.RateLimitError as exc:
        if exc.code != "slo_unattainable":
            raise
        result.shed_s = time.perf_counter() - start
        return ""
    async for chunk in stream:
        if chunk.usage is not None:
            result.output_tokens = chunk.usage.completion_tokens
        if any(choice.delta.content for choice in chunk.choices):
            reply.extend(choice.delta.content for choice in chunk.choices if choice.delta.content)
            now = time.perf_counter()
            if last is None:
                result.ttft_s = now - start
            else:
                result.itl_s.append(now - last)
            last = now
    result.e2e_s = time.perf_counter() - start
    result.ok = True
    return "".join(reply)


async def run_serve_bench_async(
    url: str,
    *,
    model: str | None = None,
    num_prompts: int = 100,
    request_rate: float = math.inf,
    workload: str = "seed-mix",
    short: int = 20,
    long: int = 200,
    max_tokens: int | None = None,
    seed: int = 0,
    api_key: str | None = None,
    timeout: float | None = None,
    max_concurrency: int | None = None,
    progress: bool = True,
    conversations: int = 16,
    turns: int = 4,
    first_turn_len: int = 256,
    tokenizer: str | None = None,
    metrics_url: str | None = None,
    think_time: float = 0.0,
    priority: int = 0,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    shed: bool = False,
) -> dict:
    """Run the load (see the module docstring) and return the results dict. ``timeout`` in seconds.

    ``multi-turn`` (:mod:`cluster.bench.serving.serve_prefix`): ``conversations`` × ``turns`` requests of
    ``max_tokens`` (default 32) output tokens; conversations start at ``request_rate`` (Poisson,
    ``inf``: all at once), their turns one after the other, ``think_time`` s after the previous
    reply ended; ``num_prompts`` is not used. It needs
    the model's tokenizer (``tokenizer``; default the ``root`` model of ``GET /v1/models``) to size
    the opening passages (``first_turn_len`` tokens). Every workload scrapes ``metrics_url``
    (default ``/metrics`` next to ``/v1``) before and after for the prefix cache's hit rate and
    speculative decoding's acceptance. ``seed`` also draws input-grounded's prompts.
    ``priority``: every request's (vLLM's field). ``slo_ttft_ms``, ``slo_tpot_ms``, ``shed``: every request's latency targets
    (:func:`slo_headers`); the results then count the requests that met them (as measured here),
    missed them, or were shed.
    """
    import openai

    from cluster.bench.serving import serve_prefix as sp

    multi_turn = workload == "multi-turn"
    if multi_turn:
        for name, value in (("--conversations", conversations), ("--turns", turns), ("--first-turn-len", first_turn_len)):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"--max-tokens must be at least 1, got {max_tokens}")
        if think_time < 0:
            raise ValueError(f"--think-time must be >= 0, got {think_time}")
        prompts = [(None, max_tokens or 32)] * (conversations * turns)
        offsets = arrival_offsets(conversations, request_rate, seed)
    else:
        prompts = bench_prompts(workload, num_prompts, short=short, long=long, max_tokens=max_tokens, seed=seed)
        offsets = arrival_offsets(len(prompts), request_rate, seed)
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {max_concurrency}")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"--timeout must be positive, got {timeout}")
    headers = slo_headers(slo_ttft_ms, slo_tpot_ms, shed)
    results = [RequestResult(index=i, max_tokens=n) for i, (_, n) in enumerate(prompts)]
    if multi_turn:
        for r in results:
            r.conversation, r.turn = divmod(r.index, turns)
            r.turn += 1
    metrics_url = metrics_url or sp.metrics_url_of(url)
    logs = [sp.ConversationLog() for _ in range(conversations if multi_turn else len(prompts))]
    bar = None
    async with openai.AsyncOpenAI(base_url=url, api_key=api_key or "EMPTY", max_retries=0, timeout=timeout) as client:
        try:
            listed = (await client.models.list()).data
        except Exception:  # noqa: BLE001 - only needed when --model is not given
            if model is None:
                raise
            listed = []
        if not listed and model is None:
            raise ValueError(f"{url}/models lists no model; pass --model")
        root = (listed[0].model_extra or {}).get("root") if listed else None  # Carpool's: the model folder or hub id
        model = model or listed[0].id
        tok = None
        if multi_turn:
            name = tokenizer or root or model
            try:
                tok = await asyncio.to_thread(sp.load_tokenizer, name)
            except Exception as exc:  # noqa: BLE001
                raise ValueError(f"multi-turn needs the model's tokenizer; {name!r} did not load ({exc}); pass --tokenizer") from None
            openings = await asyncio.to_thread(sp.opening_messages, tok, conversations, first_turn_len)
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(prompts), desc="bench serve", unit="req")
        semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        metrics_before = await sp.scrape_metrics(metrics_url, api_key)
        start = time.perf_counter()

        async def send(result: RequestResult, prompt, n: int) -> tuple[bool, str]:
            reply = ""
            try:
                if semaphore is None:
                    reply = await _one_request(client, model, result.index, prompt, n, result, headers, priority)
                else:
                    async with semaphore:
                        reply = await _one_request(client, model, result.index, prompt, n, result, headers, priority)
            except asyncio.CancelledError:
                result.error = f"cancelled: not done within --timeout {timeout} s"
                raise
            except Exception as exc:  # noqa: BLE001 - every failure is a reported error
                result.error = f"{type(exc).__name__}: {exc}"
            finally:
                if bar is not None:
                    bar.update(1)
            return result.ok, reply

        async def task(i: int) -> None:
            delay = start + offsets[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if multi_turn:
                turn_result = lambda turn: results[i * turns + turn - 1]  # noqa: E731
                await sp.run_conversation(
                    lambda turn, chat: send(turn_result(turn), chat, prompts[0][1]), i, openings[i], turns, logs[i], think_time
                )
            else:
                sent = sp.SentTurn(sent_at=time.perf_counter(), messages=[{"role": "user", "content": prompts[i][0]}])
                logs[i].turns.append(sent)
                sent.ok, sent.reply = await send(results[i], prompts[i][0], prompts[i][1])

        tasks = [asyncio.create_task(task(i)) for i in range(len(offsets))]
        done, pending = await asyncio.wait(tasks, timeout=timeout)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - start
        metrics_after = await sp.scrape_metrics(metrics_url, api_key)
    if bar is not None:
        bar.close()
    scraped = [None if m is None else sp.parse_prefix_cache_counters(m) for m in (metrics_before, metrics_after)]
    prefix_cache = sp.counter_deltas(*scraped)
    spec_decode = sd.served_deltas(metrics_before, metrics_after)
    if prefix_cache is not None or multi_turn:
        if tok is None:  # the other workloads load it only when the server reports a hit rate
            try:
                tok = await asyncio.to_thread(sp.load_tokenizer, tokenizer or root or model)
            except Exception:  # noqa: BLE001 - then there is no best rate to report
                tok = None
        best = await asyncio.to_thread(sp.best_hit_rate, tok, logs) if tok is not None else None
        prefix_cache = {**(prefix_cache or {"queries": None, "hits": None, "hit_rate": None, "replicas": {}}), "best": best}
    if prefix_cache is not None:
        prefix_cache["metrics_url"] = metrics_url
    extra = {"conversations": conversations, "turns": turns, "first_turn_len": first_turn_len, "think_time_s": think_time} if multi_turn else {}
    return summarize(results, duration, url=url, model=model, request_rate=request_rate, workload=workload,
                     seed=seed, max_concurrency=max_concurrency, timeout=timeout, prefix_cache=prefix_cache,
                     spec_decode=spec_decode, priority=priority, slo={"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms, "shed": shed} if headers else None,
                     **extra)


def run_serve_bench(url: str, **kwargs) -> dict:
    """Synchronous :func:`run_serve_bench_async` (runs its own event loop)."""
    return asyncio.run(run_serve_bench_async(url, **kwargs))


def serve_main(url: str, *, json_path: str | Path | None = None, **kwargs) -> dict:
    """Run the bench, print the table, write JSON to ``json_path`` if given; return the results."""
    summary = run_serve_bench(url, **kwargs)
    print(format_table(summary), flush=True)
    if json_path is not None:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2) + "\n")
    return summary
