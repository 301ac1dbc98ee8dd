"""Run a workload through Carpool's engine under one policy, recording what every seat did per step.

Step accounting (the scheduler's): step ``n`` of a run is its ``n``-th non-empty
``engine.step()``, as the engine's step records number them (:meth:`LLMEngine.add_step_observer
<replica.engine.llm_engine.LLMEngine.add_step_observer>`; the bench reads the engine through its
public seams only: ``info()``, ``stats()``, step records, the requests it built). A prefill step
computes a request's whole prompt (when it fits the token budget) and samples its first output
token, so a request with ``max_tokens=N`` admitted at step ``s`` finishes at step ``s + N - 1``;
its seat is free for a waiting request at step ``s + N``. In the seed example A–D are admitted at
step 1 and E is added after step 1, so E takes B's seat at step 21 and finishes at step 50 under
``continuous``; under ``static`` it waits for D (step 200) and finishes at step 230.
``finish_step`` is relative to the run's first step.

Latency is seconds from the request's arrival (when the bench added it) to the end of the step
that produced its last token. Throughput is generated tokens ÷ the run's wall time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Collection
from dataclasses import dataclass, field

from cluster.bench.workloads.base import BenchRequest


@dataclass
class RequestResult:
    id: str
    output_tokens: int
    finish_step: int | None
    latency_s: float
    ttft_s: float | None = None


@dataclass
class Segment:
    """A request's stay in one seat: steps ``[start_step, end_step]`` (inclusive).

    ``padding``: the request had already finished and its row was computed only as padding
    (static policy).
    """

    seat: int
    id: str
    start_step: int
    end_step: int
    padding: bool = False


@dataclass
class RunResult:
    """One policy's (or baseline's) run of a workload."""

    policy: str
    output_tokens: int
    wall_s: float
    num_steps: int | None
    output_tokens_per_s: float
    latency_s: dict[str, float]
    requests: list[RequestResult]
    occupancy: list[Segment] = field(default_factory=list)
    num_seats: int | None = None
    vs_carpool: float | None = None  # output_tokens_per_s ÷ Carpool continuous's
    spec_decode: dict | None = None  # speculative decoding: this run's counters (cluster/bench/engine/spec_decode.py)

    @classmethod
    def from_requests(
        cls,
        policy: str,
        requests: list[RequestResult],
        *,
        wall_s: float,
        num_steps: int | None,
        num_seats: int | None,
        occupancy: list[Segment] | None = None,
    ) -> "RunResult":
        """Totals derived from the per-request results: output tokens, tok/s over ``wall_s`` seconds, latency summary."""
        tokens = sum(r.output_tokens for r in requests)
        return cls(
            policy=policy,
            output_tokens=tokens,
            wall_s=wall_s,
            num_steps=num_steps,
            output_tokens_per_s=tokens / wall_s if wall_s > 0 else 0.0,
            latency_s=latency_summary([r.latency_s for r in requests]),
            requests=requests,
            occupancy=occupancy or [],
            num_seats=num_seats,
        )


def run_result_from_dict(data: dict) -> RunResult:
    """The inverse of ``dataclasses.asdict`` for a :class:`RunResult` read back from ``--json``."""
    fields = dict(data)
    fields["requests"] = [RequestResult(**q) for q in data.get("requests", [])]
    fields["occupancy"] = [Segment(**s) for s in data.get("occupancy", [])]
    return RunResult(**fields)


def latency_summary(values: list[float]) -> dict[str, float]:
    """mean, p50, p90, p99 (nearest rank on the sorted values)."""
    ordered = sorted(values)
    if not ordered:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))]

    return {"mean": statistics.fmean(ordered), "p50": pct(50), "p90": pct(90), "p99": pct(99)}


class SeatTracker:
    """Assigns each running request a seat (lane) and records per-seat segments from the real steps.

    After every step the bench passes the step's rows and the ids of the requests running after
    it (a :class:`~replica.engine.stats.StepRecord`'s ``rows`` and ``running``): a request keeps
    its seat while it is running (static padding included) and takes the lowest free seat when it
    first appears.
    """

    def __init__(self, num_seats: int) -> None:
        self.num_seats = num_seats
        self.seat_of: dict[str, int] = {}
        self.open: dict[int, Segment] = {}
        self.segments: list[Segment] = []

    def record(self, step: int, rows, running: Collection[str], name_of: dict[str, str]) -> None:
        """Step ``step`` (of the run) ran ``rows`` (``StepRow``s); ``running``: request ids seated after it;
        ``name_of``: each request id's workload id."""
        for row in rows:
            rid = row.request_id
            seat = self.seat_of.get(rid)
            if seat is None:
                seat = self._free_seat()
                self.seat_of[rid] = seat
            padding = bool(row.is_padding)
            current = self.open.get(seat)
            if current is not None and current.padding == padding and current.end_step == step - 1 and current.id == name_of[rid]:
                current.end_step = step
            else:
                if current is not None:
                    self.segments.append(current)
                self.open[seat] = Segment(seat, name_of[rid], step, step, padding)
        still = set(running)
        for rid in [rid for rid in self.seat_of if rid not in still]:
            del self.seat_of[rid]  # finished and removed, or preempted: its seat is free

    def _free_seat(self) -> int:
        taken = set(self.seat_of.values())
        for seat in range(self.num_seats):
            if seat not in taken:
                return seat
        return len(taken)  # cannot happen while the scheduler respects max_num_seqs

    def finish(self) -> list[Segment]:
        self.segments.extend(self.open.values())
        self.open.clear()
        return sorted(self.segments, key=lambda s: (s.start_step, s.seat))


def run_policy(llm, workload: list[BenchRequest], policy: str, *, progress: bool = True) -> RunResult:
    """Run ``workload`` (tokenized) through ``llm``'s engine under ``policy``; returns its result.

    The engine must be idle. Output lengths are exact (greedy, ``ignore_eos``). The engine's policy
    is set back to what it was afterwards.
    """
    engine = llm.engine
    if engine.has_unfinished_requests():
        raise RuntimeError("the engine still has requests; run workloads one at a time")
    previous_policy = engine.info().batching_policy
    engine.set_batching_policy(policy)
    try:
        return _run(engine, workload, policy, progress)
    finally:
        engine.set_batching_policy(previous_policy)


def _run(engine, workload: list[BenchRequest], policy: str, progress: bool) -> RunResult:
    from tqdm import tqdm

    from replica import SamplingParams

    first_step = engine.stats().num_steps
    num_seats = engine.info().max_num_seqs
    tracker = SeatTracker(num_seats)
    pending = sorted(workload, key=lambda r: r.arrival_step)
    name_of: dict[str, str] = {}
    requests = []  # (BenchRequest, engine Request)
    bar = tqdm(total=sum(r.max_tokens for r in workload), desc=policy, unit="tok", disable=not progress, leave=False)

    remove_observer = engine.add_step_observer(
        lambda record: tracker.record(record.step - first_step, record.rows, record.running, name_of)
    )
    start = time.monotonic()
    try:
        while pending or engine.has_unfinished_requests():
            done_steps = engine.stats().num_steps - first_step
            idle = not engine.has_unfinished_requests()
            while pending and (pending[0].arrival_step <= done_steps or idle):
                item = pending.pop(0)
                idle = False
                params = SamplingParams(
                    temperature=0, max_tokens=item.max_tokens, ignore_eos=True, prompt_logprobs=item.prompt_logprobs,
                    structured_outputs=item.structured_outputs,
                )
                request = engine.make_request(f"bench-{policy}-{item.id}", prompt_token_ids=item.prompt_token_ids, sampling_params=params)
                engine.add_prepared_request(request)
                name_of[request.request_id] = item.id
                requests.append((item, request))
            outputs = engine.step()
            bar.update(sum(len(o.new_token_ids) for o in outputs))
    finally:
        remove_observer()
    wall = time.monotonic() - start
    bar.close()
    order = {id(item): i for i, item in enumerate(workload)}
    requests.sort(key=lambda pair: order[id(pair[0])])

    results = [
        RequestResult(
            id=item.id,
            output_tokens=r.num_output_tokens,
            finish_step=r.finish_step - first_step if r.finish_step is not None else None,
            latency_s=r.finished_time - r.arrival_time,
            ttft_s=r.first_token_time - r.arrival_time if r.first_token_time is not None else None,
        )
        for item, r in requests
    ]
    return RunResult.from_requests(
        policy,
        results,
        wall_s=wall,
        num_steps=engine.stats().num_steps - first_step,
        num_seats=num_seats,
        occupancy=tracker.finish(),
    )


def warm_up(llm, prompt_token_ids: list[int], num_seqs: int, max_tokens: int = 4) -> None:
    """A short untimed run at full batch width, so allocation and first-call costs stay out of timings."""
    from replica import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompt_token_ids=[prompt_token_ids] * num_seqs, sampling_params=params)


def bench_engine_kwargs(
    *, model, dtype, device, max_num_seqs, max_num_batched_tokens, kv_cache_memory, attention_backend, compile, threads,
    cuda_graphs: bool = True, async_scheduling: bool | None = None, tensor_parallel_size: int = 1,
    speculative_config: dict | None = None, quantization: str | None = None,
) -> dict:
    """``LLM`` keyword arguments of a benchmark's engine from its command-line settings (``model``,
    ``kv_cache_memory`` (bytes) and ``speculative_config`` (a dict of its keys) left to the defaults
    when None); sets torch's thread count when ``threads`` is given."""
    if threads:
        import torch

        torch.set_num_threads(threads)
    kwargs = dict(
        dtype=dtype, device=device, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        attention_backend=attention_backend, compile=compile, cuda_graphs=cuda_graphs, async_scheduling=async_scheduling,
        tensor_parallel_size=tensor_parallel_size, quantization=quantization,
    )
    if model:
        kwargs["model"] = model
    if kv_cache_memory:
        kwargs["kv_cache_memory"] = kv_cache_memory
    if speculative_config is not None:
        kwargs["speculative_config"] = speculative_config
    return kwargs
