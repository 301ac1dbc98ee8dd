"""The served benchmarks: load on a Carpool app over HTTP, with the real ``openai`` client.

* ``serve``: the load generator against a running server, its summary and table
  (``serve_report``) and prefix caching seen from it (``serve_prefix``: the served multi-turn
  workload, the hit rate from ``/metrics``).
* ``overhead``: the seed mix in-process and served by a local app, side by side.
* ``lora_routing``: adapter-aware vs seat-only routing of LoRA requests on a served app.
* ``autoscale``: the Carpool autoscaling policy against Serve's, on a 2-node Ray cluster, with its
  closed-loop clients and replica sampler (``autoscale_load``).

The top layer of ``cluster.bench`` below its command group (``cli``, ``options``): it may import
``cluster.bench.workloads`` and ``cluster.bench.engine``.
"""
