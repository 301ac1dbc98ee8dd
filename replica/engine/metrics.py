"""Every Carpool metric, defined once (prometheus-client).

Names carry the ``carpool:`` prefix and vLLM's semantics where the name is shared, so that habits
and dashboards carry over (vLLM docs, "Production Metrics"). Labels: ``model_name`` and
``replica`` on every series, ``finished_reason`` on ``request_success_total``, ``position`` on
``spec_decode_num_accepted_tokens_per_pos_total``, ``adapter`` on ``lora_requests_running`` and
``lora_requests_waiting``, ``priority`` on ``num_preemptions_by_priority_total``,
``request_queue_time_by_priority_seconds`` and ``time_to_first_token_by_priority_seconds``,
``outcome`` on ``requests_slo_total`` (``met``, ``missed``, ``shed``: requests with latency
targets, ``replica.protocol.slo``; aborted ones are not counted).

Priority: the label is the request's ``priority`` (vLLM's: lower runs first) as a decimal string,
clamped into ``[-PRIORITY_LABEL_BOUND, PRIORITY_LABEL_BOUND]``, the two ends written ``<=-4`` and
``>=4`` (:func:`priority_label`): at most 9 values, whatever priorities clients send. Under the
``fcfs`` scheduling policy every request has priority 0, so one series each.

LoRA: one series per adapter name, for the adapters the engine knows (in host memory, or with
requests running or waiting), removed when it forgets one (unloaded, or evicted from host memory,
and its last request gone), so their number stays bounded by the engine's own; never a list of names packed into one
label value (vLLM's ``vllm:lora_requests_info``), which makes a new series for every combination.
They are set from the engine's ``lora_stats()`` (:meth:`EngineMetrics.on_lora_stats`), which the
Serve replica calls when ``/metrics`` is scraped.

Each engine gets its own :class:`EngineMetrics` over its own ``CollectorRegistry``; a replica
exports that registry's text and the ingress merges all replicas' text into one ``/metrics``.
The engine calls the ``on_*`` hooks from its step loop; gauges are refreshed from the engine's
state after every step and command, so they return to idle (0 running, 0 waiting, 0 KV usage)
as soon as the load ends, aborts included.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Latency buckets (seconds) that resolve both a GPU (milliseconds) and this CPU (up to minutes).
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0,
)  # fmt: skip
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FRACTION_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
FINISH_REASONS = ("stop", "length", "abort")
SLO_OUTCOMES = ("met", "missed", "shed")
PRIORITY_LABEL_BOUND = 4  # priority labels: -3 .. 3 as themselves, "<=-4" and ">=4" for the rest
CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar")  # replica.protocol.constraints.KINDS
COMPILE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def priority_label(priority: int) -> str:
    """The ``priority`` label of a request's priority: ``str(priority)`` within
    ``(-PRIORITY_LABEL_BOUND, PRIORITY_LABEL_BOUND)``, else ``"<=-4"`` or ``">=4"`` (9 values at most)."""
    if priority <= -PRIORITY_LABEL_BOUND:
        return f"<=-{PRIORITY_LABEL_BOUND}"
    if priority >= PRIORITY_LABEL_BOUND:
        return f">={PRIORITY_LABEL_BOUND}"
    return str(priority)


class EngineMetrics:
    """The metrics of one engine (one replica), with its ``model_name`` and ``replica`` labels.

    Args:
        model_name: the served model's name (label ``model_name``).
        replica: this replica's id (label ``replica``).
        registry: where the series live (a fresh one by default, so engines never collide).
    """

    def __init__(self, model_name: str, replica: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.labels = {"model_name": model_name, "replica": replica}
        names = list(self.labels)
        r = self.registry

        def gauge(name, doc):
            return Gauge(f"carpool:{name}", doc, names, registry=r).labels(**self.labels)

        def counter(name, doc):
            return Counter(f"carpool:{name}", doc, names, registry=r).labels(**self.labels)

        def histogram(name, doc, buckets):
            return Histogram(f"carpool:{name}", doc, names, buckets=buckets, registry=r).labels(**self.labels)

        # Seats
        self.num_slots = gauge("num_slots", "Seats in the batch (max_num_seqs).")
        self.num_requests_running = gauge("num_requests_running", "Requests in running seats.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting for a seat.")
        self.slot_utilization = gauge("slot_utilization", "Running requests / seats, 0-1, after the last step.")
        self.batch_occupancy = histogram(
            "batch_occupancy", "Per step: running requests / seats (0-1).", FRACTION_BUCKETS
        )
        # KV cache
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "KV cache usage, 0-1 (1 = every block used).")
        self.kv_cache_blocks_total = gauge("kv_cache_blocks_total", "KV blocks in the pool.")
        self.kv_cache_blocks_free = gauge("kv_cache_blocks_free", "KV blocks free.")
        self.num_preemptions = counter(
            "num_preemptions",
            "Preemptions by recompute (KV blocks ran out, or a waiting request of higher priority took the seat or blocks).",
        )
        self._preemptions_by_priority = Counter(
            "carpool:num_preemptions_by_priority",
            "Preemptions by recompute, by the preempted request's priority (label priority: -3 to 3, else <=-4 or >=4).",
            names + ["priority"], registry=r,
        )
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Tokens of admitted requests looked up in the prefix cache (vLLM's semantics)."
        )
        self.prefix_cache_hits = counter("prefix_cache_hits", "Of the tokens looked up, those found in the prefix cache.")
        # Tokens and steps
        self.prompt_tokens = counter("prompt_tokens", "Prefilled prompt tokens, counted once per request.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens computed per step (prefill + decode).", TOKEN_BUCKETS
        )
        self.step_duration = histogram("step_duration_seconds", "Wall time of one engine step.", LATENCY_BUCKETS)
        # Requests
        self._success = Counter(
            "carpool:request_success",
            "Finished requests by finish reason (stop, length, abort).",
            names + ["finished_reason"],
            registry=r,
        )
        self.request_success = {
            reason: self._success.labels(**self.labels, finished_reason=reason) for reason in FINISH_REASONS
        }
        self.requests_aborted = counter("requests_aborted", "Requests aborted (client gone or cancelled).")
        self.requests_rejected = counter("requests_rejected", "Requests refused at admission (bad input, overload).")
        self._slo = Counter(
            "carpool:requests_slo",
            "Requests with latency targets by outcome: met, missed (served late), shed (refused "
            "with 429 at arrival, as they asked, since they were predicted late). Goodput: met.",
            names + ["outcome"],
            registry=r,
        )
        self.requests_slo = {outcome: self._slo.labels(**self.labels, outcome=outcome) for outcome in SLO_OUTCOMES}
        # Embeddings (/v1/embeddings; also counted above as requests, with their prompt tokens)
        self.embedding_requests = counter("embedding_requests", "Embedding requests served (one per input).")
        self.embedding_prompt_tokens = counter("embedding_prompt_tokens", "Prompt tokens of the embedding requests served.")
        self.embedding_request_latency = histogram(
            "embedding_request_latency_seconds", "Arrival to embedding (an embedding request's whole time).", LATENCY_BUCKETS
        )
        # Structured output
        self._constrained = Counter(
            "carpool:structured_output_requests",
            "Requests with an output constraint, by kind (json, json_object, regex, choice, grammar).",
            names + ["kind"],
            registry=r,
        )
        self.structured_output_requests = {
            kind: self._constrained.labels(**self.labels, kind=kind) for kind in CONSTRAINT_KINDS
        }
        self.grammar_compile_time = histogram(
            "grammar_compile_seconds", "Compiling a new output constraint (cache misses only).", COMPILE_BUCKETS
        )
        self.grammar_cache_hits = counter(
            "grammar_cache_hits", "Constrained requests whose constraint was compiled already (cached)."
        )
        # Speculative decoding (vLLM's ``spec_decode`` counters; stay at 0 without a drafter)
        self.spec_decode_num_drafts = counter(
            "spec_decode_num_drafts", "Rows verified with at least one draft token (one per row per step)."
        )
        self.spec_decode_num_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Draft tokens proposed and verified by the target model."
        )
        self.spec_decode_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Of the verified draft tokens, those accepted (kept in the output)."
        )
        # LoRA adapters (stay at 0 without LoRA; see on_lora_stats)
        self._lora_running = Gauge(
            "carpool:lora_requests_running", "Requests running with a LoRA adapter, by adapter.", names + ["adapter"], registry=r
        )
        self._lora_waiting = Gauge(
            "carpool:lora_requests_waiting",
            "Requests with a LoRA adapter waiting (for a seat, or for a device slot for their adapter), by adapter.",
            names + ["adapter"], registry=r,
        )
        self.lora_adapters_loaded = gauge("lora_adapters_loaded", "LoRA adapters in device slots (at most max_loras).")
        self.lora_adapter_loads = counter(
            "lora_adapter_loads", "LoRA adapters loaded into a device slot (a miss: the adapter was not in a slot)."
        )
        self._lora_adapters: set[str] = set()  # adapters with series now
        self._lora_loads_seen = 0  # the engine's num_slot_loads counted so far
        self._accepted_per_pos = Counter(
            "carpool:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by draft position (label position, 0-based).",
            names + ["position"],
            registry=r,
        )
        # Latency
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first generated token (TTFT).", LATENCY_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between two generated tokens of a request (ITL).", LATENCY_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduled (time waiting for a seat).", LATENCY_BUCKETS
        )
        self._queue_time_by_priority = Histogram(
            "carpool:request_queue_time_by_priority_seconds",
            "Arrival to first scheduled, by the request's priority (label priority: -3 to 3, else <=-4 or >=4).",
            names + ["priority"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self._ttft_by_priority = Histogram(
            "carpool:time_to_first_token_by_priority_seconds",
            "Arrival to first generated token (TTFT), by the request's priority (label as on the queue time).",
            names + ["priority"], buckets=LATENCY_BUCKETS, registry=r,
        )
        # Priority 0 (every request under fcfs) exists from the start, so that rate() over a
        # scrape window also counts the first request of that priority.
        for by_priority in (self._preemptions_by_priority, self._queue_time_by_priority, self._ttft_by_priority):
            by_priority.labels(**self.labels, priority=priority_label(0))

    # ---- hooks the engine calls -----------------------------------------------------------------
    def on_state(self, *, num_slots: int, num_running: int, num_waiting: int, num_free_blocks: int, num_total_blocks: int) -> None:
        """Refresh the gauges from the engine's state (after every step and command)."""
        self.num_slots.set(num_slots)
        self.num_requests_running.set(num_running)
        self.num_requests_waiting.set(num_waiting)
        self.slot_utilization.set(num_running / num_slots)
        self.kv_cache_blocks_total.set(num_total_blocks)
        self.kv_cache_blocks_free.set(num_free_blocks)
        self.kv_cache_usage_perc.set(1.0 - num_free_blocks / num_total_blocks if num_total_blocks else 0.0)  # pooling engine: no KV

    def on_step(self, *, num_tokens: int, num_running: int, num_slots: int, duration_s: float) -> None:
        """One step ran: ``num_tokens`` computed with ``num_running`` seats taken, in ``duration_s``."""
        self.iteration_tokens.observe(num_tokens)
        self.batch_occupancy.observe(num_running / num_slots)
        self.step_duration.observe(duration_s)

    def on_preempted(self, priorities: Sequence[int]) -> None:
        """A step's scheduling preempted requests of these priorities (one entry a request), whether
        or not it then ran anything."""
        self.num_preemptions.inc(len(priorities))
        for priority in priorities:
            self._preemptions_by_priority.labels(**self.labels, priority=priority_label(priority)).inc()

    def on_prefix_cache(self, *, queries: int, hits: int) -> None:
        """A step's admissions looked ``queries`` tokens up in the prefix cache and found ``hits``."""
        if queries:
            self.prefix_cache_queries.inc(queries)
            self.prefix_cache_hits.inc(hits)

    def on_spec_decode(
        self, *, num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int, accepted_per_position: list[int]
    ) -> None:
        """One step verified drafts: ``num_drafts`` rows with at least one draft token, holding
        ``num_draft_tokens`` draft tokens, of which ``num_accepted_tokens`` were accepted;
        ``accepted_per_position[j]``: the rows that accepted draft ``j`` (0-based). Every position is
        counted, zeros included, so that its series exists once drafted."""
        self.spec_decode_num_drafts.inc(num_drafts)
        self.spec_decode_num_draft_tokens.inc(num_draft_tokens)
        self.spec_decode_num_accepted_tokens.inc(num_accepted_tokens)
        for position, accepted in enumerate(accepted_per_position):
            self._accepted_per_pos.labels(**self.labels, position=str(position)).inc(accepted)

    def on_lora_stats(self, stats: dict) -> None:
        """Set the LoRA series from the engine's ``lora_stats()``: ``loaded`` and ``cached`` (adapter
        names), ``running`` and ``waiting`` (``{name: requests}``), ``num_slot_loads`` (since start).
        An adapter the engine no longer knows (not in host memory, no request) loses its series."""
        running, waiting = stats.get("running") or {}, stats.get("waiting") or {}
        known = set(stats.get("cached") or ()) | set(running) | set(waiting)
        for name in self._lora_adapters - known:
            self._lora_running.remove(*self.labels.values(), name)
            self._lora_waiting.remove(*self.labels.values(), name)
        for name in known:
            self._lora_running.labels(**self.labels, adapter=name).set(running.get(name, 0))
            self._lora_waiting.labels(**self.labels, adapter=name).set(waiting.get(name, 0))
        self._lora_adapters = known
        self.lora_adapters_loaded.set(len(stats.get("loaded") or ()))
        loads = int(stats.get("num_slot_loads") or 0)
        if loads > self._lora_loads_seen:
            self.lora_adapter_loads.inc(loads - self._lora_loads_seen)
            self._lora_loads_seen = loads

    def on_first_scheduled(self, queue_time_s: float, priority: int = 0) -> None:
        """A request (of ``priority``) was scheduled for the first time, ``queue_time_s`` after arrival."""
        self.request_queue_time.observe(queue_time_s)
        self._queue_time_by_priority.labels(**self.labels, priority=priority_label(priority)).observe(queue_time_s)

    def on_prompt_prefilled(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_token(self, *, first: bool, since_previous_s: float, priority: int = 0) -> None:
        """A request (of ``priority``) got a token: TTFT for its first, ITL for the others."""
        self.generation_tokens.inc()
        if first:
            self.time_to_first_token.observe(since_previous_s)
            self._ttft_by_priority.labels(**self.labels, priority=priority_label(priority)).observe(since_previous_s)
        else:
            self.inter_token_latency.observe(since_previous_s)

    def on_finished(self, finish_reason: str, e2e_s: float) -> None:
        """A request finished (once per request), aborts included."""
        self.request_success[finish_reason].inc()
        self.e2e_request_latency.observe(e2e_s)
        if finish_reason == "abort":
            self.requests_aborted.inc()

    def on_embedding(self, num_prompt_tokens: int, latency_s: float) -> None:
        """An embedding request got its vector, ``latency_s`` after its arrival."""
        self.embedding_requests.inc()
        self.embedding_prompt_tokens.inc(num_prompt_tokens)
        self.embedding_request_latency.observe(latency_s)

    def on_rejected(self) -> None:
        self.requests_rejected.inc()

    def on_slo(self, outcome: str) -> None:
        """A request with latency targets ended: ``met``, ``missed`` or ``shed`` (:data:`SLO_OUTCOMES`)."""
        self.requests_slo[outcome].inc()

    def on_grammar_compiled(self, kind: str, seconds: float, cached: bool) -> None:
        """A constrained request's constraint was compiled (``cached``: copied from the cache)."""
        self.structured_output_requests[kind].inc()
        if cached:
            self.grammar_cache_hits.inc()
        else:
            self.grammar_compile_time.observe(seconds)

    def exposition(self) -> bytes:
        """This engine's series in the Prometheus text format."""
        return generate_latest(self.registry)






