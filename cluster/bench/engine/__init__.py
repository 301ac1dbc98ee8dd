"""The in-process benchmarks: the engine run in this process, no server.

* ``runner``: one workload through the engine under one policy, with the step accounting and the
  seat recording; ``baselines``: the same requests through transformers; ``plots``: a run's PNGs;
  ``spec_decode``: speculative decoding's acceptance, from the engine's counters or a server's
  ``/metrics``.
* The commands: ``offline`` (continuous vs static batching), ``profile`` (a step's time),
  ``prefix`` (prefix caching on vs off), ``spec_bench`` (speculative decoding on vs off) and
  ``lora_bench`` (LoRA requests against the base model).

Above ``cluster.bench.workloads``; below ``cluster.bench.serving``, which reuses ``spec_decode``.
"""
