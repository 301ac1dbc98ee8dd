"""Benchmarks of the engine: continuous vs static batching, reproduced and plotted.

* :func:`offline_main` (``carpool bench offline`` / ``python -m cluster.bench offline``): runs a
  workload in-process under both policies, optionally against transformers; table, JSON, PNGs.
* ``carpool bench prefix`` (:mod:`cluster.bench.engine.prefix`): prefix caching on vs off
  in-process, on the shared-prefix and multi-turn workloads (:mod:`cluster.bench.workloads.prefix`);
  TTFT, tok/s, hit rate.
* ``carpool bench serve`` (:mod:`cluster.bench.serving.serve`): load on a live server; throughput,
  TTFT, ITL and e2e latency percentiles, errors, the prefix cache hit rate; table and JSON.
* ``carpool bench overhead`` (:mod:`cluster.bench.serving.overhead`): the seed mix in-process and
  served by a local app, side by side: what HTTP and Serve cost.
* ``carpool bench profile`` (:mod:`cluster.bench.engine.profile`): where a step's time goes (torch
  profiler), by phase and by operator.
* ``carpool bench lora-routing`` (:mod:`cluster.bench.serving.lora_routing`, its adapters and
  workload in :mod:`cluster.bench.workloads.lora`): adapter-aware vs seat-only routing of LoRA
  requests on a served app; adapter loads per request, the split over replicas, tok/s.
* :data:`bench_app`: the typer group to attach to the ``carpool`` command.

Packages, lowest layer first (``tests/unit/test_layers.py``): ``workloads`` (what is sent: the seed
mix, sweep, ``input_grounded``, the prefix workloads, the LoRA adapters and requests), ``engine``
(the in-process benches: ``offline``, ``profile``, ``prefix``, ``spec_bench``, ``lora_bench``, and
what they share: ``runner``, the step accounting and seat recording; ``baselines``, transformers;
``plots``; ``spec_decode``, speculative decoding's acceptance, offline and served) and ``serving``
(the benches over HTTP: ``serve`` with ``serve_report`` and ``serve_prefix``, ``overhead``,
``lora_routing``, ``autoscale`` with ``autoscale_load``). On top of them: ``cli`` (the typer
group), ``options`` (each command's options) and ``__main__``.
"""

from __future__ import annotations

__all__ = ["offline_main", "bench_app", "main"]


def __getattr__(name):  # lazy: importing the package must stay light (no torch, no typer needed)
    if name == "offline_main":
        from cluster.bench.engine.offline import offline_main

        return offline_main
    if name in ("bench_app", "main"):
        from cluster.bench import cli

        return getattr(cli, name)
    raise AttributeError(name)
