"""Offline throughput: continuous vs static batching, and transformers ``generate``, in one run.

The seed workload: ``num_requests`` prompts, half asking for ``short`` output tokens and half for
``long`` (interleaved, ``ignore_eos`` so the lengths are exact). Each policy runs the same
requests in this process on the same model; transformers' own ``generate`` runs them in static
batches of ``max_num_seqs`` (left-padded, every batch runs to its longest member, as a static
batch does). Throughput = requested output tokens ÷ wall seconds.

Run: ``python -m cluster.bench`` (``--help`` for options).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass, field

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


@dataclass
class PolicyResult:
    """One policy's run: throughput, time, steps and each request's finish step and latency."""

    policy: str
    output_tokens: int
    wall_s: float
    num_steps: int
    output_tokens_per_s: float
    latency_s: dict[str, float] = field(default_factory=dict)
    requests: list[dict] = field(default_factory=list)


def seed_mix(num_requests: int, short: int, long: int) -> list[tuple[str, int]]:
    """(prompt, max_tokens) pairs: even indices ``short`` tokens, odd ones ``long``."""
    return [(PROMPTS[i % len(PROMPTS)], short if i % 2 == 0 else long) for i in range(num_requests)]


def _chat(tokenizer, prompt: str) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]

    return {"mean": statistics.fmean(ordered), "p50": pct(50), "p90": pct(90), "p99": pct(99)}


def run_policy(llm, workload_ids: list[tuple[list[int], int]], policy: str) -> PolicyResult:
    """Run every request through ``llm``'s engine under ``policy`` (all arrive at time 0)."""
    from replica import SamplingParams

    engine = llm.engine
    engine.scheduler.policy = policy
    start_step = engine.scheduler.step_count
    requests = [
        engine.make_request(
            None, prompt_token_ids=ids, sampling_params=SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        )
        for ids, n in workload_ids
    ]
    start = time.monotonic()
    for request in requests:
        request.arrival_time = start
        engine.add_prepared_request(request)
    while engine.has_unfinished_requests():
        engine.step()
    wall = time.monotonic() - start
    tokens = sum(r.num_output_tokens for r in requests)
    latencies = [r.finished_time - r.arrival_time for r in requests]
    return PolicyResult(
        policy=policy,
        output_tokens=tokens,
        wall_s=wall,
        num_steps=engine.scheduler.step_count - start_step,
        output_tokens_per_s=tokens / wall,
        latency_s=_percentiles(latencies),
        requests=[
            {
                "id": i,
                "output_tokens": r.num_output_tokens,
                "finish_step": r.finish_step - start_step,
                "latency_s": r.finished_time - r.arrival_time,
            }
            for i, r in enumerate(requests)
        ],
    )


def run_transformers_static(model, tokenizer, workload_ids, batch_size: int) -> PolicyResult:
    """transformers ``generate`` in static batches of ``batch_size`` (left padding, greedy)."""
    import torch

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    start = time.monotonic()
    latencies = []
    tokens = 0
    with torch.inference_mode():
        for first in range(0, len(workload_ids), batch_size):
            batch = workload_ids[first : first + batch_size]
            width = max(len(ids) for ids, _ in batch)
            input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids, _ in batch])
            mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in batch])
            steps = max(n for _, n in batch)
            model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=steps,
                min_new_tokens=steps,  # ignore EOS, as the engine runs do
                do_sample=False,
                pad_token_id=pad,
            )
            tokens += sum(n for _, n in batch)  # requested tokens, not padding
            latencies.extend([time.monotonic() - start] * len(batch))
    wall = time.monotonic() - start
    return PolicyResult(
        policy="transformers-static",
        output_tokens=tokens,
        wall_s=wall,
        num_steps=0,
        output_tokens_per_s=tokens / wall,
        latency_s=_percentiles(latencies),
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model id or folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--short", type=int, default=20, help="output tokens of the short half")
    parser.add_argument("--long", type=int, default=200, help="output tokens of the long half")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)

    from replica import LLM

    kwargs = {"dtype": args.dtype, "max_num_seqs": args.max_num_seqs}
    if args.model:
        kwargs["model"] = args.model
    llm = LLM(**kwargs)
    workload = [(_chat(llm.tokenizer, p), n) for p, n in seed_mix(args.num_requests, args.short, args.long)]
    # Warm up (allocator, kernels) outside the timed runs.
    llm.generate(prompt_token_ids=[workload[0][0]], sampling_params=None)

    results = [run_policy(llm, workload, "continuous"), run_policy(llm, workload, "static")]
    if not args.no_transformers:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(llm.engine.model_path, dtype=llm.engine.runner.dtype)
        model.eval()
        results.append(run_transformers_static(model, llm.tokenizer, workload, args.max_num_seqs))
    continuous = results[0].output_tokens_per_s
    summary = {
        "model": llm.engine.config.model,
        "dtype": str(llm.engine.runner.dtype),
        "num_requests": args.num_requests,
        "max_num_seqs": args.max_num_seqs,
        "results": [asdict(r) for r in results],
        "speedup": continuous / results[1].output_tokens_per_s,
    }
    print(f"{'policy':<22}{'tokens':>8}{'wall s':>9}{'steps':>7}{'tok/s':>9}{'vs carpool':>12}{'p50 lat':>9}{'p99 lat':>9}")
    for r in results:
        print(
            f"{r.policy:<22}{r.output_tokens:>8}{r.wall_s:>9.1f}{r.num_steps:>7}{r.output_tokens_per_s:>9.1f}"
            f"{r.output_tokens_per_s / continuous:>11.2f}x{r.latency_s['p50']:>9.1f}{r.latency_s['p99']:>9.1f}"
        )
    print(f"continuous / static speedup: {summary['speedup']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return summary


if __name__ == "__main__":
    main()
