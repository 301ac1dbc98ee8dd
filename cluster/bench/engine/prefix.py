"""``carpool bench prefix``: prefix caching on vs off, on workloads that resend prompt prefixes.

:func:`prefix_main` builds two engines of the same model in this process, one with
``enable_prefix_caching=True`` and one with ``False``, warms both up, then runs each workload
(:mod:`cluster.bench.workloads.prefix`) first with caching on, then off, and prints a table per
workload: TTFT p50/p90, output tok/s, the hit rate, and the on/off ratios.

* ``shared-prefix``: ``num_requests`` requests sharing a ``system_prompt_len``-token system prompt,
  distinct short questions, ``output_len`` tokens each; all at once (``request_rate=inf``) or one
  every ``1 / request_rate`` s.
* ``multi-turn``: ``num_conversations`` × ``num_turns``; turn ``t + 1``'s prompt is turn ``t``'s
  prompt + its output ids + a follow-up question's ids, and it arrives when turn ``t`` finishes
  (closed loop, plus ``think_time`` s).

How it counts. A request's arrival is when it is due (the start, its slot at the steady rate, or
its previous turn's finish), even if the engine is in the middle of a step then; TTFT is the end
of the step that sampled its first token minus that arrival, so it includes the queueing.
Throughput is output tokens ÷ the run's wall seconds. The hit rate is the engine's counters'
delta over the run (``EngineStats.prefix_cache_hits / prefix_cache_queries``, tokens, vLLM's
semantics: a request's whole prompt is queried when it is admitted without blocks).
``best_hit_rate`` replays the same prompts and computed tokens through one unbounded cache
(:func:`cluster.bench.workloads.prefix.simulate_prefix_cache`). Every request generates exactly
``output_len`` tokens (greedy, ``ignore_eos``). Each run starts from an empty cache: the warm-up's
blocks are dropped (``BlockManager.reset_prefix_cache``).

JSON (``json_path``)::

    {"model", "dtype", "device", "threads", "max_num_seqs", "max_num_batched_tokens", "output_len",
     "workloads": [{"workload": "shared-prefix", <its settings>, "num_requests", "prompt_tokens",
                    "shared_prefix_tokens" (shared-prefix only),
                    "results": [{"caching": "on" | "off", "output_tokens", "prompt_tokens", "wall_s",
                                 "num_steps", "output_tokens_per_s", "ttft_s": {mean, p50, p90, p99},
                                 "latency_s": {...}, "prefix_cache_queries", "prefix_cache_hits",
                                 "hit_rate", "best_hit_rate", "ttft_s_by_turn" (multi-turn: {turn: {...}}),
                                 "requests": [{"id", "conversation", "turn", "prompt_tokens",
                                               "cached_tokens", "output_tokens", "arrival_s",
                                               "ttft_s", "latency_s"}, ...]}, ...],
                    "ratios": {"ttft_p50_off_over_on", "ttft_p90_off_over_on", "tok_s_on_over_off"}}, ...]}
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

from cluster.bench.engine.runner import bench_engine_kwargs, latency_summary
from cluster.bench.workloads import prefix as pw

WORKLOADS = ("shared-prefix", "multi-turn")
SETTINGS = ("on", "off")


@dataclass
class PrefixRequestResult:
    id: str
    prompt_tokens: int
    cached_tokens: int  # where its first scheduled chunk started: the prefix it found cached
    output_tokens: int
    arrival_s: float  # after the run's start
    ttft_s: float
    latency_s: float
    conversation: int | None = None
    turn: int | None = None


@dataclass
class PrefixRunResult:
    caching: str
    output_tokens: int
    prompt_tokens: int
    wall_s: float
    num_steps: int
    output_tokens_per_s: float
    ttft_s: dict[str, float]
    latency_s: dict[str, float]
    prefix_cache_queries: int
    prefix_cache_hits: int
    hit_rate: float
    best_hit_rate: float
    requests: list[PrefixRequestResult] = field(default_factory=list)
    ttft_s_by_turn: dict[str, dict[str, float]] | None = None  # multi-turn: {"1": {mean, p50, ...}, ...}


def _cache_counters(engine) -> tuple[int, int]:
    """(queries, hits) since the engine started: its stats snapshot."""
    stats = engine.stats()
    return stats.prefix_cache_queries, stats.prefix_cache_hits


def run_prefix_workload(
    llm,
    workload: str,
    requests: list[pw.PrefixRequest],
    *,
    caching: str,
    request_rate: float = math.inf,
    num_turns: int = 1,
    think_time: float = 0.0,
    chat_template: bool = True,
    progress: bool = True,
) -> PrefixRunResult:
    """Run ``requests`` through ``llm``'s (idle) engine; see the module docstring.

    ``shared-prefix``: ``requests`` arrive at the start, or ``1 / request_rate`` s apart.
    ``multi-turn``: ``requests`` are the conversations' first turns (all at the start); each
    finished turn below ``num_turns`` queues the next one (:func:`prefix_workloads.next_turn`),
    due ``think_time`` s after it finished.
    """
    from tqdm import tqdm

    from replica import SamplingParams

    engine = llm.engine
    if engine.has_unfinished_requests():
        raise RuntimeError("the engine still has requests; run workloads one at a time")
    total = len(requests) * (num_turns if workload == "multi-turn" else 1)
    bar = tqdm(total=total, desc=f"{workload}, caching {caching}", unit="req", disable=not progress, leave=False)

    order = itertools.count()
    start = time.monotonic()
    due: list[tuple[float, int, pw.PrefixRequest]] = []
    for i, item in enumerate(requests):
        offset = i / request_rate if workload == "shared-prefix" and not math.isinf(request_rate) else 0.0
        heapq.heappush(due, (start + offset, next(order), item))
    live: dict[str, tuple[pw.PrefixRequest, object]] = {}
    cached_at_start: dict[str, int] = {}
    done: list[tuple[pw.PrefixRequest, object]] = []
    queries0, hits0 = _cache_counters(engine)
    first_step = engine.stats().num_steps

    def note_cached(record) -> None:  # a request's first row starts after its cached prompt tokens
        for row in record.rows:
            cached_at_start.setdefault(row.request_id, row.start)

    remove_observer = engine.add_step_observer(note_cached)
    try:
        while due or engine.has_unfinished_requests():
            now = time.monotonic()
            while due and due[0][0] <= now:
                arrival, _, item = heapq.heappop(due)
                params = SamplingParams(temperature=0, max_tokens=item.max_tokens, ignore_eos=True)
                request = engine.make_request(
                    f"prefix-{caching}-{item.id}", prompt_token_ids=item.prompt_token_ids, sampling_params=params, arrival_time=arrival
                )
                engine.add_prepared_request(request)
                live[request.request_id] = (item, request)
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, due[0][0] - time.monotonic()))
                continue
            for o in engine.step():
                if not o.finished:
                    continue
                item, request = live.pop(o.request_id)
                done.append((item, request))
                bar.update(1)
                if workload == "multi-turn" and item.turn < num_turns:
                    following = pw.next_turn(llm.tokenizer, item, request.output_token_ids, chat_template=chat_template)
                    heapq.heappush(due, (request.finished_time + think_time, next(order), following))
    finally:
        remove_observer()
    wall = time.monotonic() - start
    bar.close()
    queries1, hits1 = _cache_counters(engine)

    done.sort(key=lambda pair: pair[1].arrival_time)
    # Every computed token is K/V the engine could have kept: the prompt and all outputs but the last.
    best = pw.simulate_prefix_cache(
        ((r.prompt_token_ids, r.prompt_token_ids + r.output_token_ids[:-1]) for _, r in done),
        engine.info().block_size,
    )
    results = [
        PrefixRequestResult(
            id=item.id,
            prompt_tokens=len(r.prompt_token_ids),
            cached_tokens=cached_at_start.get(r.request_id, 0),
            output_tokens=r.num_output_tokens,
            arrival_s=r.arrival_time - start,
            ttft_s=r.first_token_time - r.arrival_time,
            latency_s=r.finished_time - r.arrival_time,
            conversation=item.conversation,
            turn=item.turn,
        )
        for item, r in done
    ]
    output_tokens = sum(q.output_tokens for q in results)
    queries, hits = queries1 - queries0, hits1 - hits0
    return PrefixRunResult(
        caching=caching,
        output_tokens=output_tokens,
        prompt_tokens=sum(q.prompt_tokens for q in results),
        wall_s=wall,
        num_steps=engine.stats().num_steps - first_step,
        output_tokens_per_s=output_tokens / wall if wall > 0 else 0.0,
        ttft_s=latency_summary([q.ttft_s for q in results]),
        latency_s=latency_summary([q.latency_s for q in results]),
        prefix_cache_queries=queries,
        prefix_cache_hits=hits,
        hit_rate=hits / queries if queries else 0.0,
        best_hit_rate=best["hit_rate"],
        requests=results,
        ttft_s_by_turn={
            str(t): latency_summary([q.ttft_s for q in results if q.turn == t]) for t in sorted({q.turn for q in results})
        } if workload == "multi-turn" else None,
    )


def warm_up(llm, prompt_token_ids: list[int], num_seqs: int) -> None:
    """Untimed: the same prompt on every seat, twice (with caching on, the second round and all
    but the first request of each start from a cached prefix: both prefill paths run), then the
    prefix cache is emptied so that the timed run starts cold."""
    from replica import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for _ in range(2):
        llm.generate(prompt_token_ids=[prompt_token_ids] * num_seqs, sampling_params=params)
    llm.engine.reset_prefix_cache()


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def prefix_main(
    workloads: list[str] | tuple[str, ...] = WORKLOADS,
    *,
    model: str | None = None,
    dtype: str = "auto",
    device: str = "cpu",
    max_num_seqs: int = 32,
    max_num_batched_tokens: int = 512,
    kv_cache_memory: int | None = None,
    num_requests: int = 64,
    system_prompt_len: int = 512,
    output_len: int = 32,
    request_rate: float = math.inf,
    num_conversations: int = 16,
    num_turns: int = 4,
    first_turn_len: int = 256,
    think_time: float = 0.0,
    settings: list[str] | tuple[str, ...] = SETTINGS,
    threads: int | None = None,
    attention_backend: str = "auto",
    compile: bool = True,
    chat_template: bool = True,
    json_path: str | Path | None = None,
    progress: bool = True,
    out: TextIO | None = None,
) -> dict:
    """Run each of ``workloads`` with prefix caching on and off; print tables; return the summary.

    Args:
        workloads: ``shared-prefix`` and/or ``multi-turn`` (in that order of running).
        model, dtype, device, max_num_seqs, max_num_batched_tokens, kv_cache_memory,
            attention_backend, compile: both engines' settings (``EngineConfig``).
        num_requests, system_prompt_len, output_len, request_rate: shared-prefix's size, its
            system prompt's text tokens, every request's output tokens (multi-turn's too), and its
            arrivals (requests/s, evenly spaced; ``inf``: all at the start).
        num_conversations, num_turns, first_turn_len, think_time: multi-turn's size, the tokens of
            each conversation's opening passage, and the pause between a turn's end and the next.
        settings: which of ``on``, ``off`` to run (both by default: the ratios need both).
        threads: torch threads (default: torch's own choice).
        chat_template: render the chats with the model's template (else plain ``Role:`` lines).
    Raises:
        ValueError: an unknown workload or setting, or a bad size.
    """
    out = out or sys.stdout
    workloads = list(workloads)
    for name in workloads:
        if name not in WORKLOADS:
            raise ValueError(f"workload must be one of {list(WORKLOADS)}, got {name!r}")
    if not workloads:
        raise ValueError("no workload given")
    unknown = set(settings) - set(SETTINGS)
    if unknown or not settings:
        raise ValueError(f"settings must be among {list(SETTINGS)}, got {list(settings)}")
    settings = [s for s in SETTINGS if s in settings]
    for name, value in (("num_requests", num_requests), ("system_prompt_len", system_prompt_len), ("output_len", output_len),
                        ("num_conversations", num_conversations), ("num_turns", num_turns), ("first_turn_len", first_turn_len)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if not request_rate > 0:
        raise ValueError(f"request_rate must be positive (or inf), got {request_rate}")
    if think_time < 0:
        raise ValueError(f"think_time must be >= 0, got {think_time}")

    import torch

    from replica import LLM

    engine_kwargs = bench_engine_kwargs(
        model=model, dtype=dtype, device=device, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        kv_cache_memory=kv_cache_memory, attention_backend=attention_backend, compile=compile, threads=threads,
    )
    engines = {s: LLM(**engine_kwargs, enable_prefix_caching=(s == "on")) for s in settings}
    llm = engines[settings[0]]
    tokenizer = llm.tokenizer
    info = llm.engine.info()
    summary = {
        "model": info.model,
        "dtype": info.dtype,
        "device": device,
        "threads": torch.get_num_threads(),
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "block_size": info.block_size,
        "output_len": output_len,
        "settings": settings,
        "workloads": [],
    }
    for name in workloads:
        if name == "shared-prefix":
            requests = pw.shared_prefix(tokenizer, num_requests, system_prompt_len, output_len, chat_template=chat_template)
            entry = {
                "workload": name, "num_requests": num_requests, "system_prompt_len": system_prompt_len,
                "shared_prefix_tokens": pw.common_prefix_len(r.prompt_token_ids for r in requests),
                "request_rate": "inf" if math.isinf(request_rate) else request_rate,
            }
            run = dict(request_rate=request_rate)
        else:
            requests = pw.multi_turn_openings(tokenizer, num_conversations, first_turn_len, output_len, chat_template=chat_template)
            entry = {
                "workload": name, "num_conversations": num_conversations, "num_turns": num_turns,
                "first_turn_len": first_turn_len, "think_time_s": think_time, "num_requests": num_conversations * num_turns,
            }
            run = dict(num_turns=num_turns, think_time=think_time)
        # Warm-up prompt: the workload's first prompt reversed (same length, shares no prefix).
        warm = list(reversed(requests[0].prompt_token_ids))
        results = []
        for s in settings:
            warm_up(engines[s], warm, max_num_seqs)
            results.append(
                run_prefix_workload(engines[s], name, requests, caching=s, chat_template=chat_template, progress=progress, **run)
            )
        by = {r.caching: r for r in results}
        ratios = {}
        if len(by) == 2:
            on, off = by["on"], by["off"]
            ratios = {
                "ttft_p50_off_over_on": _ratio(off.ttft_s["p50"], on.ttft_s["p50"]),
                "ttft_p90_off_over_on": _ratio(off.ttft_s["p90"], on.ttft_s["p90"]),
                "tok_s_on_over_off": _ratio(on.output_tokens_per_s, off.output_tokens_per_s),
            }
        entry.update(prompt_tokens=results[0].prompt_tokens, results=[asdict(r) for r in results], ratios=ratios)
        summary["workloads"].append(entry)
        _print_table(entry, summary, out)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(summary, f, indent=1)
        print(f"json: {json_path}", file=out)
    return summary


def _print_table(entry: dict, summary: dict, out: TextIO) -> None:
    if entry["workload"] == "shared-prefix":
        what = (f"{entry['num_requests']} requests, {entry['shared_prefix_tokens']}-token shared prefix, "
                f"rate {entry['request_rate']} req/s")
    else:
        what = f"{entry['num_conversations']} conversations x {entry['num_turns']} turns, closed loop"
    print(
        f"\n{entry['workload']}: {what}; {summary['output_len']} output tokens each; {summary['max_num_seqs']} seats, "
        f"{summary['max_num_batched_tokens']}-token steps; {summary['model']} ({summary['dtype']}, {summary['threads']} thread{'s' if summary['threads'] != 1 else ''})",
        file=out,
    )
    header = (f"{'caching':<9}{'prompt tok':>11}{'out tok':>9}{'wall s':>9}{'steps':>7}{'tok/s':>9}"
              f"{'TTFT p50':>10}{'p90':>8}{'lat p50':>9}{'hit rate':>10}{'best':>7}")
    print(header, file=out)
    print("-" * len(header), file=out)
    for r in entry["results"]:
        print(
            f"{r['caching']:<9}{r['prompt_tokens']:>11}{r['output_tokens']:>9}{r['wall_s']:>9.1f}{r['num_steps']:>7}"
            f"{r['output_tokens_per_s']:>9.1f}{r['ttft_s']['p50']:>10.2f}{r['ttft_s']['p90']:>8.2f}{r['latency_s']['p50']:>9.2f}"
            f"{r['hit_rate']:>10.1%}{r['best_hit_rate']:>7.1%}",
            file=out,
        )
    for r in entry["results"]:
        if r.get("ttft_s_by_turn"):
            cells = ", ".join(f"turn {t}: {v['p50']:.2f}" for t, v in r["ttft_s_by_turn"].items())
            print(f"  caching {r['caching']}: TTFT p50 by turn (s): {cells}", file=out)
    ratios = entry["ratios"]
    if ratios:
        def fmt(v):
            return "-" if v is None else f"{v:.2f}x"

        print(
            f"on vs off: TTFT p50 {fmt(ratios['ttft_p50_off_over_on'])} lower, p90 {fmt(ratios['ttft_p90_off_over_on'])} lower; "
            f"tok/s {fmt(ratios['tok_s_on_over_off'])} higher",
            file=out,
        )
