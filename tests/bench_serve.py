"""Throughput of the seed workload over HTTP (``carpool serve``) next to the in-process engine.

The seed workload: 100 chat requests, half with 20 and half with 200 output tokens (interleaved),
greedy, ``ignore_eos`` so the lengths are exact: 11,000 output tokens in all.

1. In-process: ``replica.LLM`` (same engine settings, torch using every core) generates the
   prompts in this process; tok/s = output tokens ÷ wall seconds. It runs first, before Ray
   exists, and is freed before step 2.
2. HTTP: a local Ray cluster with the Serve app (``--replicas``, default auto = one per core on a
   CPU machine; each replica one core and one torch thread), all 100 requests sent at once with
   the ``openai`` async client (non-streaming); tok/s = output tokens (from ``usage``) ÷ wall
   seconds from the first request sent to the last response received.

Run: ``.venv/bin/python -m tests.bench_serve [--replicas N] [--max-num-seqs 32] [--dtype auto]
[--json out.json]``. Not collected by pytest (the name does not start with ``test_``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import time

from cluster.bench.workloads import PROMPTS  # the same prompts as `carpool bench offline`


def seed_workload(num_requests: int = 100, short: int = 20, long: int = 200) -> list[tuple[str, int]]:
    """``(prompt, max_tokens)``: even indices ``short``, odd ones ``long``."""
    return [(PROMPTS[i % len(PROMPTS)], short if i % 2 == 0 else long) for i in range(num_requests)]


async def _http_run(base_url: str, model: str, workload: list[tuple[str, int]]) -> dict:
    import openai

    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=3600) as client:
        await client.chat.completions.create(  # warm-up: the ingress fetches its limits, the replica runs once
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0
        )

        async def one(prompt: str, max_tokens: int):
            t0 = time.monotonic()
            out = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                temperature=0, extra_body={"ignore_eos": True},
            )
            return out.usage.completion_tokens, time.monotonic() - t0

        start = time.monotonic()
        results = await asyncio.gather(*(one(p, n) for p, n in workload))
        wall = time.monotonic() - start
    tokens = sum(t for t, _ in results)
    expected = sum(n for _, n in workload)
    assert tokens == expected, f"usage counted {tokens} output tokens, expected {expected}"
    latencies = sorted(lat for _, lat in results)
    return {"output_tokens": tokens, "wall_s": wall, "tok_per_s": tokens / wall,
            "latency_p50_s": latencies[len(latencies) // 2], "latency_max_s": latencies[-1]}


def run_http(args, workload) -> dict:
    import ray
    from ray import serve

    from cluster import app as carpool_app
    from cluster.config import EngineConfig, ServeConfig
    from tests.e2e.conftest import free_port

    config = ServeConfig(
        replicas=args.replicas, port=free_port(), app_name="bench",
        engine=EngineConfig(dtype=args.dtype, max_num_seqs=args.max_num_seqs),
    )
    url = carpool_app.run(config)
    replicas = carpool_app.resolve_replicas(config)
    try:
        result = asyncio.run(_http_run(url, config.model_name, workload))
    finally:
        serve.shutdown()
        ray.shutdown()
    return {"replicas": replicas, **result}


def run_in_process(args, workload) -> dict:
    import torch

    from replica.llm import LLM
    from replica.request import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(dtype=args.dtype, max_num_seqs=args.max_num_seqs)
    tok = llm.tokenizer

    def ids(prompt: str) -> list[int]:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
        return tok(text, add_special_tokens=False)["input_ids"]

    prompts = [ids(p) for p, _ in workload]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in workload]
    llm.generate(prompt_token_ids=[prompts[0]], sampling_params=SamplingParams(temperature=0, max_tokens=2))  # warm-up
    start = time.monotonic()
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    wall = time.monotonic() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"threads": torch.get_num_threads(), "output_tokens": tokens, "wall_s": wall, "tok_per_s": tokens / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", default="auto", help="replica count or auto (default auto)")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="seats per replica / in-process engine")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None, help="torch threads in-process (default: torch's choice)")
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    workload = seed_workload(args.num_requests)
    local = run_in_process(args, workload)
    print(f"in-process ({local['threads']} threads):  {local['output_tokens']} tokens in {local['wall_s']:.1f} s = {local['tok_per_s']:.1f} tok/s", flush=True)
    gc.collect()
    http = run_http(args, workload)
    print(f"HTTP       ({http['replicas']} replicas): {http['output_tokens']} tokens in {http['wall_s']:.1f} s = {http['tok_per_s']:.1f} tok/s", flush=True)
    print(f"HTTP / in-process: {http['tok_per_s'] / local['tok_per_s']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": "seed-mix 50x20 + 50x200, greedy, ignore_eos", "max_num_seqs": args.max_num_seqs,
                       "dtype": args.dtype, "http": http, "in_process": local}, f, indent=2)


if __name__ == "__main__":
    main()
