"""``carpool bench spec``: speculative decoding against the same engine without it, side by side.

For each workload and seat count, two engines of the same settings (one with
``--speculative-config``, one without) run the same requests (greedy, exact lengths), one after the
other in this process, in turn, twice (the best run of each is reported, and each round's
ratio): output tok/s, inter-token latency (ITL: a step's gap shared out over the tokens it brings
a request), the tokens are checked equal, and the drafts' acceptance. Then the
step cost by rows: the target's forward timed at 1 to 20 tokens, in chunks of ``1 + k`` (the
shape of rows that verify ``k`` drafts), which is what the planner weighs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from cluster.bench.engine.runner import bench_engine_kwargs, latency_summary
from cluster.bench.workloads.base import seed_mix, tokenize
from cluster.bench.workloads.input_grounded import input_grounded

WORKLOADS = {
    "input-grounded": lambda n: input_grounded(n, seed=0),
    "seed-mix": lambda n: seed_mix(n),
}
COST_ROWS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20)
ROUNDS = 2  # each engine runs the workload this many times, in turn; the best run of each is kept


def _run(llm, workload) -> dict:
    """Run ``workload`` (tokenized) to the end, all requests at once; tok/s, ITL, tokens."""
    from replica import SamplingParams

    engine = llm.engine
    before = engine.spec_decode_stats.as_dict()
    last: dict[str, float] = {}
    gaps: list[float] = []
    requests = []
    for item in workload:
        params = SamplingParams(temperature=0, max_tokens=item.max_tokens, ignore_eos=True)
        requests.append(engine.add_request(prompt_token_ids=item.prompt_token_ids, sampling_params=params))
    started = time.monotonic()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.monotonic()
        for out in outputs:
            n = len(out.new_token_ids)
            if out.request_id in last and n:
                gaps += [(now - last[out.request_id]) / n] * n
            if n:
                last[out.request_id] = now
    wall = time.monotonic() - started
    after = engine.spec_decode_stats.as_dict()
    tokens = sum(r.num_output_tokens for r in requests)
    drafts = after["num_drafts"] - before["num_drafts"]
    drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    return {
        "output_tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "itl_s": latency_summary(gaps),
        "token_ids": [list(r.output_token_ids) for r in requests], "num_steps": None,
        "drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
    }


def spec_main(
    *, model: str | None, dtype: str, seats: list[int], workloads: list[str], num_requests: int, threads: int,
    speculative_config: dict, compile: bool, json_path: Path | None, device: str = "cpu",
) -> dict:
    """Run the comparison (see the module docstring); print a table; returns the results."""
    from replica import LLM

    results: dict = {"speculative_config": speculative_config, "threads": threads, "device": device, "runs": []}
    for n_seats in seats:
        kwargs = bench_engine_kwargs(
            model=model, dtype=dtype, device=device, max_num_seqs=n_seats, max_num_batched_tokens=512,
            kv_cache_memory=None, attention_backend="auto", compile=compile, threads=threads,
        )
        plain = LLM(**kwargs)
        spec = LLM(**kwargs, speculative_config=speculative_config)
        for name in workloads:
            workload = WORKLOADS[name](max(num_requests, 2 * n_seats))  # every seat taken, twice over
            tokenize(workload, plain.tokenizer)
            warm = workload[: n_seats]
            for llm in (plain, spec):  # untimed: first-call costs, and the planner's first look
                _run(llm, [type(w)(**{**w.__dict__, "max_tokens": 8}) for w in warm])
            rounds = []
            for _ in range(ROUNDS):  # off, on, off, on: drift in the machine's speed hits both alike
                rounds.append((_run(plain, workload), _run(spec, workload)))
            same = all(off.pop("token_ids") == on.pop("token_ids") for off, on in rounds)
            off = max((r[0] for r in rounds), key=lambda r: r["tok_s"])
            on = max((r[1] for r in rounds), key=lambda r: r["tok_s"])
            run = {
                "workload": name, "seats": n_seats, "off": off, "on": on, "same_tokens": same,
                "tok_s_ratio": on["tok_s"] / off["tok_s"], "itl_p50_ratio": on["itl_s"]["p50"] / off["itl_s"]["p50"],
                "tok_s_ratio_by_round": [b["tok_s"] / a["tok_s"] for a, b in rounds],
            }
            results["runs"].append(run)
            print(
                f"{name:15s} seats {n_seats:2d}: tok/s {off['tok_s']:7.1f} -> {on['tok_s']:7.1f} ({run['tok_s_ratio']:.2f}x), "
                f"ITL p50 {off['itl_s']['p50'] * 1e3:6.1f} -> {on['itl_s']['p50'] * 1e3:6.1f} ms ({run['itl_p50_ratio']:.2f}x), "
                f"acceptance {on['acceptance_rate'] or 0:.2f}, mean length {on['mean_acceptance_length'] or 1:.2f}, "
                f"drafted tokens {on['draft_tokens']}, same tokens {same}, "
                f"ratio by round {', '.join(f'{x:.2f}' for x in run['tok_s_ratio_by_round'])}",
                flush=True,
            )
        k = speculative_config["num_speculative_tokens"]
        if n_seats == seats[0]:
            costs = plain.engine.time_forwards(list(COST_ROWS), 1 + k)
            results["step_cost_ms_by_tokens"] = {n: c * 1e3 for n, c in zip(COST_ROWS, costs)}
            print("step cost by tokens (chunks of %d): " % (1 + k) + ", ".join(f"{n}: {c * 1e3:.1f} ms" for n, c in zip(COST_ROWS, costs)))
        plain.close()
        spec.close()
    if json_path is not None:
        json_path.write_text(json.dumps(results, indent=2))
    return results
