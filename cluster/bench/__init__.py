"""Benchmarks of the engine: continuous vs static batching, reproduced and plotted.

* :func:`offline_main` (``carpool bench offline`` / ``python -m cluster.bench offline``): runs a
  workload in-process under both policies, optionally against transformers; table, JSON, PNGs.
* ``carpool bench prefix`` (:mod:`cluster.bench.prefix`): prefix caching on vs off in-process, on
  the shared-prefix and multi-turn workloads (:mod:`cluster.bench.prefix_workloads`); TTFT, tok/s,
  hit rate.
* ``carpool bench serve`` (:mod:`cluster.bench.serve`): load on a live server; throughput, TTFT,
  ITL and e2e latency percentiles, errors, the prefix cache hit rate; table and JSON.
* ``carpool bench overhead`` (:mod:`cluster.bench.overhead`): the seed mix in-process and served by
  a local app, side by side: what HTTP and Serve cost.
* ``carpool bench profile`` (:mod:`cluster.bench.profile`): where a step's time goes (torch
  profiler), by phase and by operator.
* ``carpool bench lora-routing`` (:mod:`cluster.bench.lora_routing`, its adapters and workload in
  :mod:`cluster.bench.lora_workload`): adapter-aware vs seat-only routing of LoRA requests on a
  served app; adapter loads per request, the split over replicas, tok/s.
* :data:`bench_app`: the typer group to attach to the ``carpool`` command.

Modules: ``workloads`` (what is run), ``input_grounded`` (the ``input-grounded`` workload: answers
that repeat or edit the prompt, for speculative decoding), ``runner`` (running it on the engine,
step accounting, seat recording), ``baselines`` (transformers), ``plots`` (matplotlib), ``offline``
(the command), ``prefix`` and ``prefix_workloads`` (prefix caching on vs off), ``serve`` (the load
generator) and ``serve_report`` (its summary and table), ``spec_decode`` (speculative decoding's
acceptance, offline and served), ``overhead`` (in-process vs served), ``profile`` (a step's time).
"""

from __future__ import annotations

__all__ = ["offline_main", "bench_app", "main"]


def __getattr__(name):  # lazy: importing the package must stay light (no torch, no typer needed)
    if name == "offline_main":
        from cluster.bench.offline import offline_main

        return offline_main
    if name in ("bench_app", "main"):
        from cluster.bench import cli

        return getattr(cli, name)
    raise AttributeError(name)
