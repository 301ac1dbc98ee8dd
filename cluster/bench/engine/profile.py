"""``carpool bench profile``: where a step's time goes, from a torch profile of real steps.

The seed mix (or ``input-grounded``, :mod:`cluster.bench.workloads.input_grounded`) runs in the engine;
after ``skip`` steps (so that the batch is in the state to look at: prefills done, ``running``
requests decoding), ``steps`` steps run under ``torch.profiler``. The table gives milliseconds per step for each phase of a step (the engine's
``carpool.*`` ``record_function`` ranges: schedule, propose_drafts, prepare_inputs, forward, sample,
verify_drafts, update, detokenize) and for the operators that take the most time (self time), which is how the numbers
in ``docs/bench/cpu-speed.md`` were taken. With ``speculative_config`` the result also has
``spec_decode``: the engine's acceptance counters over the whole run (:mod:`cluster.bench.engine.spec_decode`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from cluster.bench.engine import spec_decode as sd
from cluster.bench.workloads import base as wl
from cluster.bench.workloads.input_grounded import input_grounded

PHASES = ("carpool.schedule", "carpool.propose_drafts", "carpool.prepare_inputs", "carpool.step_message", "carpool.forward",
          "carpool.sample", "carpool.verify_drafts", "carpool.grammar_masks", "carpool.update", "carpool.detokenize")


def profile_main(
    *,
    model: str | None = None,
    dtype: str = "auto",
    device: str = "cpu",
    max_num_seqs: int = 4,
    num_requests: int = 100,
    skip: int = 20,
    steps: int = 20,
    threads: int | None = None,
    top: int = 8,
    compile: bool = True,
    attention_backend: str = "auto",
    json_path: str | Path | None = None,
    constrained_requests: int = 0,
    cuda_graphs: bool = True,
    async_scheduling: bool | None = None,
    tensor_parallel_size: int = 1,
    workload: str = "seed-mix",
    speculative_config: dict | None = None,
    quantization: str | None = None,
) -> dict:
    """Profile ``steps`` engine steps of the seed mix after ``skip`` steps; print and return
    milliseconds per step by phase and by operator (on CUDA also the kernels' busy time per step).

    ``constrained_requests``: the first N requests are constrained by
    :data:`~cluster.bench.workloads.base.ENDLESS_JSON` (same lengths); ``grammar_masks`` (part of
    ``sample``) is then their masks' cost.

    ``workload``: ``seed-mix`` or ``input-grounded`` (``num_requests`` of either);
    ``speculative_config``: the engine's (a dict of its keys; None: no speculation);
    ``quantization``: the engine's (``gguf``: the linear layers on the GGUF file's blocks).

    Raises ``ValueError`` for another workload, or if it ends before ``skip + steps`` steps.
    """
    if workload not in ("seed-mix", "input-grounded"):
        raise ValueError(f"workload must be seed-mix or input-grounded, got {workload!r}")
    import torch

    from replica import LLM, SamplingParams

    if threads:
        torch.set_num_threads(threads)
    kwargs = dict(
        dtype=dtype, device=device, max_num_seqs=max_num_seqs, compile=compile, attention_backend=attention_backend,
        cuda_graphs=cuda_graphs, async_scheduling=async_scheduling, tensor_parallel_size=tensor_parallel_size,
        quantization=quantization,
        **({"speculative_config": speculative_config} if speculative_config is not None else {}),
    )
    llm = LLM(**({"model": model} if model else {}), **kwargs)
    engine = llm.engine
    requests = wl.seed_mix(num_requests) if workload == "seed-mix" else input_grounded(num_requests)
    wl.tokenize(requests, llm.tokenizer)
    for i, r in enumerate(requests):
        constraint = {"json": wl.ENDLESS_JSON} if i < constrained_requests else None
        engine.add_request(None, prompt_token_ids=r.prompt_token_ids, sampling_params=SamplingParams(
            temperature=0, max_tokens=r.max_tokens, ignore_eos=True, structured_outputs=constraint))
    for _ in range(skip):
        engine.step()
    running = engine.stats().num_running
    activities = [torch.profiler.ProfilerActivity.CPU]
    on_cuda = torch.device(device).type == "cuda"
    if on_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            if not engine.has_unfinished_requests():
                raise ValueError(f"the workload ended before {skip + steps} steps")
            engine.step()
        wall_ms = (time.perf_counter() - started) / steps * 1e3
    while engine.has_unfinished_requests():
        engine.step()
    from torch.autograd import DeviceType

    events = prof.key_averages()
    phases: dict[str, float] = {}
    for e in prof.events():  # the host side of each range (on CUDA the ranges also appear as GPU annotations)
        if e.name in PHASES and e.device_type == DeviceType.CPU:
            phases[e.name] = phases.get(e.name, 0.0) + e.cpu_time_total / 1e3 / steps
    ops = sorted((e for e in events if not e.key.startswith("carpool.")), key=lambda e: -e.self_cpu_time_total)
    result = {
        "model": engine.info().model, "workload": workload, "max_num_seqs": max_num_seqs, "running": running, "steps": steps,
        "ms_per_step_profiled": wall_ms, "phases_ms": phases,
        "top_ops_self_ms": {e.key: e.self_cpu_time_total / 1e3 / steps for e in ops[:top]},
    }
    if speculative_config is not None:
        result["spec_decode"] = sd.engine_counters(engine)
    if not on_cuda:
        from replica.kernels.cpu_kernels import dispatch_summary

        result["cpu_kernels"] = dispatch_summary()
        print(f"CPU kernels: {result['cpu_kernels']}")
    print(f"{running} requests running; {wall_ms:.2f} ms per step under the profiler")
    if on_cuda:  # kernel time: when it is far below the step's wall time, the host is the bound
        kernels = sorted(
            (e for e in prof.key_averages() if e.device_type == DeviceType.CUDA and not e.key.startswith("carpool.")),
            key=lambda e: -e.self_device_time_total,
        )
        result["gpu_ms_per_step"] = sum(e.self_device_time_total for e in kernels) / 1e3 / steps
        result["top_kernels_ms"] = {e.key: e.self_device_time_total / 1e3 / steps for e in kernels[:top]}
        print(f"  GPU kernels busy {result['gpu_ms_per_step']:.2f} ms per step")
    for key in PHASES:
        if key in phases:
            print(f"  {key.removeprefix('carpool.'):<16}{phases[key]:9.2f} ms")
    print("  top operators (self time):")
    for key, ms in result["top_ops_self_ms"].items():
        print(f"    {key[:48]:<50}{ms:9.2f} ms")
    if result.get("spec_decode"):
        print(sd.format_spec_decode(result["spec_decode"]))
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))
    llm.close()  # a tensor-parallel engine's other ranks
    return result
