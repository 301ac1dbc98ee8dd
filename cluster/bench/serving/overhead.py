"""``carpool bench overhead``: the same workload in-process and served over HTTP, side by side.

What serving costs on top of the engine (Ray Serve, the ingress, streaming, tokenizing once per
request), measured in one run:

1. **In-process:** :class:`replica.LLM` generates the workload's prompts (the chat template applied,
   as the chat API does) with ``LLM.generate``; tok/s = output tokens ÷ wall seconds. It runs
   first, before Ray exists, and is freed before step 2.
2. **Served:** a local Ray cluster with the Carpool app (``replicas``; ``auto`` = one per core on a
   CPU machine, each with one core and one torch thread), loaded by ``carpool bench serve``'s
   client (:func:`cluster.bench.serving.serve.run_serve_bench`: streamed chat completions, the real
   ``openai`` client, all at once unless ``request_rate`` is finite).

Every request generates exactly its ``max_tokens`` (``ignore_eos``, greedy), so both runs produce
the same number of tokens. The result dict has ``in_process``, ``served`` (the serve bench's
summary) and ``served_over_in_process`` (tok/s ratio).
"""

from __future__ import annotations

import gc
import json
import math
import socket
from pathlib import Path

from cluster.bench.serving.serve import format_table, run_serve_bench
from cluster.bench.workloads import base as wl


def run_in_process(
    requests: list[wl.BenchRequest], *, model: str | None, dtype: str, max_num_seqs: int, threads: int | None
) -> dict:
    """Generate ``requests`` with ``LLM.generate`` (after a two-token warm-up); tok/s and wall seconds."""
    import time

    import torch

    from replica import LLM, SamplingParams

    if threads:
        torch.set_num_threads(threads)
    llm = LLM(**({"model": model} if model else {}), dtype=dtype, max_num_seqs=max_num_seqs)
    wl.tokenize(requests, llm.tokenizer, chat_template=True)
    prompts = [r.prompt_token_ids for r in requests]
    llm.generate(prompt_token_ids=prompts[:1], sampling_params=SamplingParams(temperature=0, max_tokens=2))
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    start = time.monotonic()
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    wall = time.monotonic() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "threads": torch.get_num_threads(), "dtype": llm.engine.info().dtype,
        "output_tokens": tokens, "wall_s": wall, "tok_per_s": tokens / wall,
    }


def run_served(
    *, model: str | None, dtype: str, max_num_seqs: int, replicas: str, num_requests: int, short: int, long: int,
    request_rate: float, progress: bool,
) -> dict:
    """Start a local Ray cluster and the app on a free port, run the serve bench, stop everything."""
    import ray
    from ray import serve

    from cluster import app as carpool_app
    from cluster.config import ServeConfig
    from replica.config.engine_config import EngineConfig

    engine = EngineConfig(**({"model": model} if model else {}), dtype=dtype, max_num_seqs=max_num_seqs)
    config = ServeConfig(replicas=replicas, port=_free_port(), app_name="bench-overhead", engine=engine)
    url = carpool_app.run(config)
    try:
        summary = run_serve_bench(
            url, num_prompts=num_requests, short=short, long=long, request_rate=request_rate, progress=progress
        )
        summary["replicas"] = carpool_app.resolve_replicas(config)
    finally:
        serve.shutdown()
        ray.shutdown()
    return summary


def overhead_main(
    *,
    model: str | None = None,
    dtype: str = "auto",
    max_num_seqs: int = 32,
    replicas: str = "auto",
    num_requests: int = 100,
    short: int = 20,
    long: int = 200,
    request_rate: float = math.inf,
    threads: int | None = None,
    json_path: str | Path | None = None,
    progress: bool = True,
) -> dict:
    """Run the seed mix in-process, then served; print both and their ratio; return the results.

    Raises ``ValueError`` for bad settings (from the engine or the serve config).
    """
    requests = wl.seed_mix(num_requests, short, long)
    local = run_in_process(requests, model=model, dtype=dtype, max_num_seqs=max_num_seqs, threads=threads)
    print(f"in-process ({local['threads']} threads): {local['output_tokens']} tokens in {local['wall_s']:.1f} s "
          f"= {local['tok_per_s']:.1f} tok/s", flush=True)
    gc.collect()
    served = run_served(
        model=model, dtype=dtype, max_num_seqs=max_num_seqs, replicas=replicas, num_requests=num_requests,
        short=short, long=long, request_rate=request_rate, progress=progress,
    )
    print(f"served ({served['replicas']} replicas):")
    print(format_table(served))
    ratio = served["output_tokens_per_s"] / local["tok_per_s"]
    print(f"served / in-process tok/s: {ratio:.2f}", flush=True)
    result = {
        "workload": f"seed-mix {num_requests} ({short}/{long} tokens), greedy, ignore_eos",
        "max_num_seqs": max_num_seqs, "dtype": local["dtype"], "in_process": local, "served": served,
        "served_over_in_process": ratio,
    }
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
