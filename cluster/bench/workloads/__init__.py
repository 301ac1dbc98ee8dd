"""The benchmarks' request sets: what each bench sends, apart from how it is run.

* ``base``: :class:`~cluster.bench.workloads.base.BenchRequest` and the built-in workloads of
  ``carpool bench offline`` (``seed-example``, ``seed-mix``, ``sweep``, a JSONL file), the prompts
  and tokenizing them.
* ``input_grounded``: the ``input-grounded`` workload (answers that repeat or edit the prompt, for
  speculative decoding by prompt lookup).
* ``prefix``: the ``shared-prefix`` and ``multi-turn`` workloads of ``carpool bench prefix`` and
  ``serve``, and the best hit rate they allow.
* ``lora``: the ``lora-routing`` bench's random PEFT adapters and its skewed stream of requests.

The lowest layer of ``cluster.bench``: it imports nothing of the benches that run these requests.
"""
