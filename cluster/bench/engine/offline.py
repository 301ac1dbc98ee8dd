"""``carpool bench offline``: continuous vs static batching on the same requests in one process.

:func:`offline_main` builds one engine, runs the workload under ``continuous`` then ``static``
(and, with ``compare=["transformers"]``, through transformers' ``generate`` in static batches and
transformers' own continuous batching), prints a table, and optionally writes JSON and PNGs.

JSON (``json_path``), one object per run under ``results``::

    {"workload": "seed-mix", "model": ..., "max_num_seqs": 4, ...,
     "results": [{"policy": "continuous", "output_tokens": 11000, "output_tokens_per_s": ...,
                  "wall_s": ..., "num_steps": ..., "latency_s": {"mean", "p50", "p90", "p99"},
                  "vs_carpool": 1.0, "num_seats": 4,
                  "requests": [{"id", "output_tokens", "finish_step", "latency_s", "ttft_s"}, ...],
                  "occupancy": [{"seat", "id", "start_step", "end_step", "padding"}, ...]}, ...],
     "speedup": <continuous tok/s ÷ static tok/s>,
     "step_speedup": <static num_steps ÷ continuous num_steps>}

``vs_carpool`` is a run's tok/s ÷ Carpool continuous's. With ``speculative_config`` the summary
also has ``speculative_config`` (every key) and ``spec_decode`` (the engine's counters since start,
warm-ups and both policies together: ``num_drafts, num_draft_tokens, num_accepted_tokens,
accepted_per_position, acceptance_rate, mean_acceptance_length``), and each Carpool run its own
``spec_decode`` (its counters alone; see :mod:`cluster.bench.engine.spec_decode`). The sweep workload has ``points`` (one
per cap, each with its own ``results`` and ``speedup``) and ``speedup`` as ``{cap: speedup}``; the
seed example adds ``article_finish_steps`` and ``matches_article``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TextIO

from cluster.bench.engine import spec_decode as sd
from cluster.bench.engine.runner import RunResult, bench_engine_kwargs, run_policy, warm_up
from cluster.bench.workloads import base as wl
from cluster.bench.workloads.input_grounded import input_grounded

POLICIES = ("continuous", "static")
# "transformers": its static generate and its continuous batching; "transformers-static": only the
# former (transformers' continuous batching ran at about 50 tok/s on an H200, too slow to wait for).
COMPARE_CHOICES = ("transformers", "transformers-static")


def offline_main(
    workload: str = "seed-mix",
    *,
    model: str | None = None,
    dtype: str = "auto",
    device: str = "cpu",
    max_num_seqs: int = 4,
    max_num_batched_tokens: int = 512,
    kv_cache_memory: int | None = None,
    num_requests: int = 100,
    short: int = 20,
    long: int = 200,
    mean_tokens: float = 64.0,
    caps: Sequence[int] = (32, 128, 512),
    seed: int = 0,
    compare: Sequence[str] = (),
    json_path: str | Path | None = None,
    plot_path: str | Path | None = None,
    threads: int | None = None,
    chat_template: bool = True,
    progress: bool = True,
    out: TextIO | None = None,
    attention_backend: str = "auto",
    compile: bool = True,
    prompt_logprobs_requests: int = 0,
    constrained_requests: int = 0,
    cuda_graphs: bool = True,
    async_scheduling: bool | None = None,
    tensor_parallel_size: int = 1,
    speculative_config: dict | None = None,
    quantization: str | None = None,
) -> dict:
    """Run one offline benchmark; print its table to ``out`` (stdout) and return the JSON summary.

    Args:
        workload: ``seed-example``, ``seed-mix``, ``sweep``, ``input-grounded``, or the path of a
            JSONL file of ``{"prompt", "max_tokens"}`` objects.
        model, dtype, device, max_num_seqs, max_num_batched_tokens, kv_cache_memory,
            attention_backend, compile, cuda_graphs, async_scheduling, tensor_parallel_size,
            speculative_config, quantization: the engine's settings (``EngineConfig``); ``model=None`` is the
            default model, ``speculative_config`` a dict of its keys (None: no speculation).
        num_requests, short, long: seed-mix's size and its two output lengths (also the sweep's
            and input-grounded's size).
        mean_tokens, caps, seed: the sweep's exponential mean, its caps, and the draw's seed
            (also input-grounded's).
        compare: ``["transformers"]`` adds transformers' static ``generate`` and its continuous
            batching (when the installed version has it), each reported as a ratio to Carpool;
            ``["transformers-static"]`` adds the former only.
        json_path: write the summary here.
        plot_path: write ``PATH-occupancy.png`` and ``PATH-latency.png`` (sweep: ``PATH-sweep.png``;
            see ``plots.plot_path``).
        threads: torch threads (default: torch's own choice).
        chat_template: wrap text prompts in the tokenizer's chat template.
        progress: show progress bars (on stderr).
        prompt_logprobs_requests: this many requests of the workload (the first ones) also ask for
            their prompt's logprobs (``prompt_logprobs=1``): what scoring costs the others.
        constrained_requests: this many requests of the workload (the last ones) are constrained
            by :data:`~cluster.bench.workloads.base.ENDLESS_JSON` (same lengths): what structured output
            costs the batch.
    Raises:
        ValueError: an unknown workload or compare target, or a bad JSONL file.
    """
    out = out or sys.stdout
    unknown = set(compare) - set(COMPARE_CHOICES)
    if unknown:
        raise ValueError(f"compare: unknown target(s) {sorted(unknown)}; choose from {list(COMPARE_CHOICES)}")
    if workload == "seed-example":
        requests = wl.seed_example()
        if max_num_seqs != wl.SEED_EXAMPLE_SEATS:
            print(f"note: the article's example has {wl.SEED_EXAMPLE_SEATS} seats; running it on {max_num_seqs}", file=out)
    elif workload == "seed-mix":
        requests = wl.seed_mix(num_requests, short, long)
    elif workload == "input-grounded":
        requests = input_grounded(num_requests, seed)
    elif workload == "sweep":
        requests = None
        caps = sorted(int(c) for c in caps)
        if not caps or caps[0] < 1:
            raise ValueError(f"caps must be positive integers, got {caps}")
    elif Path(workload).is_file():
        requests = wl.read_jsonl(workload)
    else:
        raise ValueError(f"workload must be one of {list(wl.BUILTIN_WORKLOADS)} or a JSONL file; {workload!r} is neither")

    import torch

    from replica import LLM
    from replica.kernels.cpu_kernels import dispatch_summary

    engine_kwargs = bench_engine_kwargs(
        model=model, dtype=dtype, device=device, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        kv_cache_memory=kv_cache_memory, attention_backend=attention_backend, compile=compile, threads=threads,
        cuda_graphs=cuda_graphs, async_scheduling=async_scheduling, tensor_parallel_size=tensor_parallel_size,
        speculative_config=speculative_config, quantization=quantization,
    )
    llm = LLM(**engine_kwargs)
    hf_model = None
    if {"transformers", "transformers-static"} & set(compare):
        from cluster.bench.engine.baselines import load_transformers_model

        hf_model = load_transformers_model(llm)

    info = llm.engine.info()
    summary = {
        "workload": workload,
        "model": info.model,
        "dtype": info.dtype,
        "device": device,
        "threads": torch.get_num_threads(),
        **({"cpu_kernels": dispatch_summary()} if device == "cpu" else {}),
        "tensor_parallel_size": tensor_parallel_size,
        "quantization": quantization,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "async_scheduling": info.async_scheduling,  # of the continuous run; static is synchronous
        "cuda_graphs": info.cuda_graphs,
    }
    if speculative_config is not None:
        summary["speculative_config"] = info.speculative_config
    run = dict(llm=llm, hf_model=hf_model, hf_continuous="transformers" in compare, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, progress=progress)
    if workload == "sweep":
        points = []
        for cap in caps:
            reqs = wl.sweep(num_requests, mean_tokens, cap, seed)
            wl.tokenize(reqs, llm.tokenizer, chat_template=chat_template)
            results = _run_all(reqs, **run)
            lengths = [r.max_tokens for r in reqs]
            points.append(
                {
                    "cap": cap,
                    "mean_tokens": mean_tokens,
                    "length_mean": sum(lengths) / len(lengths),
                    "length_cv": wl.coefficient_of_variation(lengths),
                    "results": [_run_dict(r) for r in results],
                    "speedup": _speedup(results),
                    "step_speedup": _step_speedup(results),
                }
            )
        summary.update(num_requests=num_requests, seed=seed, points=points, speedup={str(p["cap"]): p["speedup"] for p in points})
        _print_sweep(points, out)
        if plot_path:
            from cluster.bench.engine.plots import plot_path as png
            from cluster.bench.engine.plots import plot_sweep

            title = f"Continuous ÷ static, sweep, {num_requests} requests, {max_num_seqs} seats"
            summary["plots"] = [str(plot_sweep(points, png(plot_path, "sweep"), title))]
    else:
        wl.tokenize(requests, llm.tokenizer, chat_template=chat_template)
        for request in requests[:prompt_logprobs_requests]:
            request.prompt_logprobs = 1
        summary["prompt_logprobs_requests"] = min(prompt_logprobs_requests, len(requests))
        if constrained_requests:
            from replica.protocol.constraints import StructuredOutputsParams

            for request in requests[-constrained_requests:]:
                request.structured_outputs = StructuredOutputsParams(json=wl.ENDLESS_JSON)
        summary["constrained_requests"] = min(constrained_requests, len(requests))
        results = _run_all(requests, **run)
        summary.update(
            num_requests=len(requests),
            results=[_run_dict(r) for r in results],
            speedup=_speedup(results),
            step_speedup=_step_speedup(results),
        )
        if workload == "seed-example":
            got = {r.policy: {q.id: q.finish_step for q in r.requests} for r in results if r.policy in POLICIES}
            summary["article_finish_steps"] = wl.SEED_EXAMPLE_FINISH_STEPS
            summary["matches_article"] = got == wl.SEED_EXAMPLE_FINISH_STEPS
            _print_seed_example(results, summary["matches_article"], out)
        _print_table(results, summary, out)
        if plot_path:
            from cluster.bench.engine.plots import write_run_plots

            name = workload if workload in wl.BUILTIN_WORKLOADS else Path(workload).name
            what = f"{name}, {len(requests)} requests, {max_num_seqs} seats"
            summary["plots"] = [str(p) for p in write_run_plots(results, plot_path, what)]
    if speculative_config is not None:
        summary["spec_decode"] = sd.engine_counters(llm.engine)
    if summary.get("plots"):
        print("plots: " + ", ".join(summary["plots"]), file=out)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(summary, f, indent=1)
        print(f"json: {json_path}", file=out)
    llm.close()  # a tensor-parallel engine's other ranks
    return summary


def _run_all(requests, *, llm, hf_model, hf_continuous, max_num_seqs, max_num_batched_tokens, progress) -> list[RunResult]:
    """Both Carpool policies, then the transformers baselines if a model was loaded for them."""
    warm_up(llm, requests[0].prompt_token_ids, max_num_seqs)
    results = []
    for policy in POLICIES:
        before = sd.engine_counters(llm.engine)
        results.append(run_policy(llm, requests, policy, progress=progress))
        results[-1].spec_decode = sd.counters_delta(before, sd.engine_counters(llm.engine))
    if hf_model is not None:
        from cluster.bench.engine import baselines

        results.append(baselines.run_transformers_static(hf_model, llm.tokenizer, requests, max_num_seqs, progress=progress))
        if hf_continuous and baselines.has_transformers_continuous_batching(hf_model):
            results.append(
                baselines.run_transformers_continuous(
                    hf_model, llm.tokenizer, requests, max_num_seqs, max_num_batched_tokens, progress=progress
                )
            )
    carpool = results[0].output_tokens_per_s
    for r in results:
        r.vs_carpool = r.output_tokens_per_s / carpool if carpool else None
    return results


def _speedup(results: list[RunResult]) -> float:
    by = {r.policy: r.output_tokens_per_s for r in results}
    return by["continuous"] / by["static"] if by.get("static") else float("nan")


def _step_speedup(results: list[RunResult]) -> float:
    """Static steps ÷ continuous steps: the speedup if every step took equally long (noise-free)."""
    by = {r.policy: r.num_steps for r in results}
    return by["static"] / by["continuous"] if by.get("continuous") else float("nan")


def _run_dict(result: RunResult) -> dict:
    return asdict(result)


def _print_table(results: list[RunResult], summary: dict, out: TextIO) -> None:
    print(
        f"\n{summary['workload']}: {summary['num_requests']} requests, {summary['max_num_seqs']} seats, "
        f"{summary['model']} ({summary['dtype']}, {summary['threads']} thread{'s' if summary['threads'] != 1 else ''}"
        f"{', TP ' + str(summary['tensor_parallel_size']) if summary.get('tensor_parallel_size', 1) > 1 else ''}"
        f"{', CUDA graphs' if summary.get('cuda_graphs') else ''}"
        f"{', async scheduling' if summary.get('async_scheduling') else ''})",
        file=out,
    )
    if summary.get("cpu_kernels"):
        print(f"CPU kernels: {summary['cpu_kernels']}", file=out)
    header = f"{'run':<25}{'tokens':>8}{'wall s':>9}{'steps':>7}{'tok/s':>9}{'vs carpool':>12}{'lat mean':>10}{'p50':>8}{'p90':>8}{'p99':>8}"
    print(header, file=out)
    print("-" * len(header), file=out)
    for r in results:
        lat = r.latency_s
        steps = "-" if r.num_steps is None else str(r.num_steps)
        print(
            f"{r.policy:<25}{r.output_tokens:>8}{r.wall_s:>9.1f}{steps:>7}{r.output_tokens_per_s:>9.1f}"
            f"{r.vs_carpool:>11.2f}x{lat['mean']:>10.2f}{lat['p50']:>8.2f}{lat['p90']:>8.2f}{lat['p99']:>8.2f}",
            file=out,
        )
    print(
        f"continuous / static speedup: {summary['speedup']:.2f}x "
        f"(in steps: {summary['step_speedup']:.2f}x, the ratio if every step took equally long)",
        file=out,
    )
    for r in results:
        if r.spec_decode is not None:
            print(sd.format_spec_decode(r.spec_decode, f"spec decode, {r.policy}"), file=out)


def _print_seed_example(results: list[RunResult], matches: bool, out: TextIO) -> None:
    runs = [r for r in results if r.policy in POLICIES]
    print("\nseed example: finish step (article's) and latency per request", file=out)
    header = f"{'request':<9}{'tokens':>7}" + "".join(f"{r.policy + ' step':>20}{'latency s':>11}" for r in runs)
    print(header, file=out)
    print("-" * len(header), file=out)
    for i, (rid, n, _) in enumerate(wl.SEED_EXAMPLE):
        cells = ""
        for r in runs:
            q = r.requests[i]
            expected = wl.SEED_EXAMPLE_FINISH_STEPS[r.policy][rid]
            cells += f"{f'{q.finish_step} ({expected})':>20}{q.latency_s:>11.2f}"
        print(f"{rid:<9}{n:>7}{cells}", file=out)
    print("finish steps match the article" if matches else "finish steps DIFFER from the article (see the step accounting in cluster/bench/engine/runner.py)", file=out)


def _print_sweep(points: list[dict], out: TextIO) -> None:
    names = [r["policy"] for r in points[0]["results"]]
    header = f"{'cap':>6}{'mean len':>10}{'CV':>6}" + "".join(f"{n + ' tok/s':>26}" for n in names) + f"{'speedup':>9}{'in steps':>10}"
    print(header, file=out)
    print("-" * len(header), file=out)
    for p in points:
        cells = "".join(f"{r['output_tokens_per_s']:>26.1f}" for r in p["results"])
        print(f"{p['cap']:>6}{p['length_mean']:>10.1f}{p['length_cv']:>6.2f}{cells}{p['speedup']:>8.2f}x{p['step_speedup']:>9.2f}x", file=out)
