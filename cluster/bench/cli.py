"""The ``bench`` command group (typer): ``carpool bench offline|prefix|serve|overhead|profile|spec|lora|lora-routing|autoscale`` (also ``python -m cluster.bench ...``).

Attach it to the ``carpool`` app with ``app.add_typer(bench_app, name="bench")``. Heavy imports
(torch, transformers, matplotlib) happen only when a command runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from replica.config.engine_config import DTYPE_HELP
from replica.serve import log_to_stderr

bench_app = typer.Typer(
    name="bench",
    help="Benchmarks: continuous vs static batching in-process (offline); where a step's time goes (profile); prefix caching on vs off (prefix); load on a live server (serve); in-process vs served on one machine (overhead); adapter-aware vs seat-only routing of LoRA requests (lora-routing); the autoscaling policies on 2 nodes (autoscale).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # click's plain help: wraps long option names and defaults instead of cutting them
)


@bench_app.callback()
def _group() -> None:
    """Benchmarks: continuous vs static batching in-process (offline); prefix caching on vs off (prefix); load on a live server (serve)."""
    log_to_stderr()


@bench_app.command("offline")
def offline(
    workload: str = typer.Option(
        "seed-mix", "--workload", "-w",
        help="seed-example (the article's A-E on 4 seats), seed-mix (half 20, half 200 tokens), sweep (exponential lengths capped at --caps), input-grounded (the answer repeats or edits a paragraph or function in the prompt; 128-200 tokens), or a JSONL file of {prompt, max_tokens}.",
    ),
    model: Optional[str] = typer.Option(None, help="Hub id or local folder (default: HuggingFaceTB/SmolLM2-135M-Instruct)."),
    dtype: str = typer.Option("auto", help=DTYPE_HELP),
    device: str = typer.Option("cpu", help="cpu, cuda or cuda:N."),
    max_num_seqs: int = typer.Option(4, "--max-num-seqs", "--seats", min=1, help="Seats: requests in one batch (static batch size)."),
    max_num_batched_tokens: int = typer.Option(512, min=1, help="Token budget of one engine step."),
    kv_cache_memory: Optional[str] = typer.Option(
        None, help="KV cache budget, bytes or with a unit (1GiB, 512MiB) (default: 1 GiB on CPU; on CUDA most of the free memory, which leaves none for --compare transformers)."
    ),
    num_requests: int = typer.Option(100, min=1, help="seed-mix, sweep and input-grounded: number of requests."),
    short: int = typer.Option(20, min=1, help="seed-mix: output tokens of the short half."),
    long: int = typer.Option(200, min=1, help="seed-mix: output tokens of the long half."),
    mean_tokens: float = typer.Option(64.0, min=1.0, help="sweep: mean of the exponential output length."),
    caps: str = typer.Option("32,128,512", help="sweep: comma-separated caps on the output length."),
    seed: int = typer.Option(0, help="sweep: seed of the length draw; input-grounded: of the prompts and lengths."),
    compare: List[str] = typer.Option([], help="Also run 'transformers' (static generate, and its continuous batching when available) or 'transformers-static' (generate only); ratios to Carpool."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results as JSON here."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write PNGs PATH-occupancy.png and PATH-latency.png (sweep: PATH-sweep.png)."),
    threads: Optional[int] = typer.Option(None, min=1, help="torch threads (default: torch's choice)."),
    attention_backend: str = typer.Option("auto", help="auto (the device's fast kernels), reference, cpu or cuda."),
    compile: bool = typer.Option(True, "--compile/--no-compile", help="torch.compile the model (--no-compile: eager)."),
    cuda_graphs: bool = typer.Option(True, "--cuda-graphs/--no-cuda-graphs", help="CUDA: replay decode steps from CUDA graphs (with --compile)."),
    async_scheduling: Optional[bool] = typer.Option(None, "--async-scheduling/--no-async-scheduling", help="Schedule step N+1 while step N runs (continuous policy; the static run stays synchronous; default: on for CUDA, off on CPU)."),
    tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", "-tp", min=1, help="Ranks (processes of --threads threads on CPU, GPUs on CUDA) the model is sharded over."),
    chat_template: bool = typer.Option(True, "--chat-template/--no-chat-template", help="Wrap text prompts in the model's chat template."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Progress bars on stderr."),
    prompt_logprobs_requests: int = typer.Option(0, min=0, help="The first N requests also score their prompt (prompt_logprobs=1); not with sweep."),
    constrained_requests: int = typer.Option(0, min=0, help="The last N requests are JSON-constrained (a schema they never complete: same lengths); not with sweep."),
    speculative_config: Optional[str] = typer.Option(None, "--speculative-config", help="Speculative decoding, a JSON object of vLLM's keys (method, num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, model, adaptive), e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'; the results report its acceptance (default: off)."),
) -> None:
    """Run a workload through the engine under continuous and static batching; print a table."""
    from cluster.bench.offline import offline_main

    try:
        cap_list = [int(c) for c in caps.split(",") if c.strip()]
    except ValueError:
        _fail(f"--caps must be comma-separated integers, got {caps!r}")
    from cluster.config import parse_bytes

    try:
        kv_bytes = parse_bytes(kv_cache_memory) if kv_cache_memory is not None else None
    except ValueError as exc:
        _fail(f"--kv-cache-memory: {exc}")
    spec = _speculative_config(speculative_config)
    try:
        offline_main(
            workload, model=model, dtype=dtype, device=device, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, kv_cache_memory=kv_bytes, num_requests=num_requests, short=short, long=long,
            mean_tokens=mean_tokens, caps=cap_list, seed=seed, compare=compare, json_path=json_path,
            plot_path=plot, threads=threads, chat_template=chat_template, progress=progress,
            attention_backend=attention_backend, compile=compile, prompt_logprobs_requests=prompt_logprobs_requests,
            constrained_requests=constrained_requests, cuda_graphs=cuda_graphs, async_scheduling=async_scheduling,
            tensor_parallel_size=tensor_parallel_size, speculative_config=spec,
        )
    except ValueError as exc:
        _fail(str(exc))


@bench_app.command("prefix")
def prefix(
    workload: List[str] = typer.Option(
        ["shared-prefix", "multi-turn"], "--workload", "-w",
        help="shared-prefix (one long system prompt, distinct short questions) and/or multi-turn (each turn resends the conversation so far); repeat the option for both (default: both).",
    ),
    model: Optional[str] = typer.Option(None, help="Hub id or local folder (default: HuggingFaceTB/SmolLM2-135M-Instruct)."),
    dtype: str = typer.Option("auto", help=DTYPE_HELP),
    device: str = typer.Option("cpu", help="cpu, cuda or cuda:N."),
    max_num_seqs: int = typer.Option(32, "--max-num-seqs", "--seats", min=1, help="Seats of each engine (default: the serving default, 32)."),
    max_num_batched_tokens: int = typer.Option(512, min=1, help="Token budget of one engine step (default: the serving default, 512)."),
    kv_cache_memory: Optional[str] = typer.Option(None, help="KV cache budget of each engine, bytes or with a unit (default: 1 GiB on CPU)."),
    num_requests: int = typer.Option(64, min=1, help="shared-prefix: requests."),
    system_prompt_len: int = typer.Option(512, min=1, help="shared-prefix: tokens of the shared system prompt's text."),
    output_len: int = typer.Option(32, min=1, help="Output tokens of every request (greedy, ignore_eos)."),
    request_rate: float = typer.Option(float("inf"), "--request-rate", help="shared-prefix: requests/s, evenly spaced; inf: all at once."),
    conversations: int = typer.Option(16, min=1, help="multi-turn: conversations, all starting at once."),
    turns: int = typer.Option(4, min=1, help="multi-turn: turns per conversation."),
    first_turn_len: int = typer.Option(256, min=1, help="multi-turn: tokens of each conversation's opening passage."),
    think_time: float = typer.Option(0.0, min=0.0, help="multi-turn: seconds between a turn's end and the next turn."),
    caching: List[str] = typer.Option(["on", "off"], help="Which settings to run: on and/or off (default: both, for the ratios)."),
    threads: Optional[int] = typer.Option(None, min=1, help="torch threads (default: torch's choice)."),
    attention_backend: str = typer.Option("auto", help="auto (the device's fast kernels), reference, cpu or cuda."),
    compile: bool = typer.Option(True, "--compile/--no-compile", help="torch.compile the model (--no-compile: eager)."),
    chat_template: bool = typer.Option(True, "--chat-template/--no-chat-template", help="Render the chats with the model's chat template."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results as JSON here."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Progress bars on stderr."),
) -> None:
    """Prefix caching on vs off in-process: TTFT p50/p90, tok/s and hit rate on shared-prefix and multi-turn workloads."""
    from cluster.bench.prefix import prefix_main
    from cluster.config import parse_bytes

    try:
        kv_bytes = parse_bytes(kv_cache_memory) if kv_cache_memory is not None else None
    except ValueError as exc:
        _fail(f"--kv-cache-memory: {exc}")
    try:
        prefix_main(
            workload, model=model, dtype=dtype, device=device, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, kv_cache_memory=kv_bytes, num_requests=num_requests,
            system_prompt_len=system_prompt_len, output_len=output_len, request_rate=request_rate,
            num_conversations=conversations, num_turns=turns, first_turn_len=first_turn_len, think_time=think_time,
            settings=caching, threads=threads, attention_backend=attention_backend, compile=compile,
            chat_template=chat_template, json_path=json_path, progress=progress,
        )
    except ValueError as exc:
        _fail(str(exc))


@bench_app.command("serve")
def serve(
    url: str = typer.Option("http://127.0.0.1:8000/v1", help="Base URL of the OpenAI-compatible API."),
    model: Optional[str] = typer.Option(None, help="Model name (default: the first id of GET /v1/models)."),
    num_prompts: int = typer.Option(100, "--num-prompts", "-n", min=1, help="Number of requests."),
    request_rate: float = typer.Option(float("inf"), "--request-rate", help="Requests/s, Poisson arrivals (exponential gaps); inf: all at once."),
    seed: int = typer.Option(0, help="Seed of the inter-arrival gaps (and of input-grounded's prompts)."),
    workload: str = typer.Option("seed-mix", "--workload", "-w", help="seed-mix (half --short, half --long output tokens), input-grounded (the answer repeats or edits a paragraph or function in the prompt; 128-200 tokens), multi-turn (conversations whose every turn resends the chat so far) or a JSONL file of {prompt, max_tokens}."),
    short: int = typer.Option(20, min=1, help="seed-mix: output tokens of the short half."),
    long: int = typer.Option(200, min=1, help="seed-mix: output tokens of the long half."),
    max_tokens: Optional[int] = typer.Option(None, min=1, help="Output tokens of every request (overrides the workload's; multi-turn: default 32)."),
    conversations: int = typer.Option(16, min=1, help="multi-turn: conversations (they start at --request-rate; inf: all at once)."),
    turns: int = typer.Option(4, min=1, help="multi-turn: turns per conversation, each sent when the previous one has ended."),
    first_turn_len: int = typer.Option(256, min=1, help="multi-turn: tokens of each conversation's opening passage."),
    think_time: float = typer.Option(0.0, min=0.0, help="multi-turn: seconds between a reply's end and the conversation's next turn."),
    tokenizer: Optional[str] = typer.Option(None, help="Tokenizer (hub id or folder) for multi-turn and the best possible hit rate (default: the root model of GET /v1/models)."),
    metrics_url: Optional[str] = typer.Option(None, help="Prometheus endpoint for the prefix cache hit rate (default: /metrics next to /v1)."),
    api_key: Optional[str] = typer.Option(None, envvar="CARPOOL_API_KEY", help="Bearer key of the server."),
    timeout: Optional[float] = typer.Option(None, help="Bound on the whole run in seconds; requests not done are cancelled and counted as errors."),
    max_concurrency: Optional[int] = typer.Option(None, min=1, help="Most requests in flight at once (default: unbounded)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results as JSON here."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Progress bar on stderr."),
) -> None:
    """Load a running server with streaming chat requests; print throughput, TTFT, ITL, e2e latency (ms), prefix cache hit rate
    and, when the server speculates, the drafts' acceptance."""
    from cluster.bench.serve import serve_main

    try:
        summary = serve_main(
            url, json_path=json_path, model=model, num_prompts=num_prompts, request_rate=request_rate, seed=seed,
            workload=workload, short=short, long=long, max_tokens=max_tokens, api_key=api_key, timeout=timeout,
            max_concurrency=max_concurrency, progress=progress, conversations=conversations, turns=turns,
            first_turn_len=first_turn_len, tokenizer=tokenizer, metrics_url=metrics_url, think_time=think_time,
        )
    except ValueError as exc:
        _fail(str(exc))
    if summary["errors"]:
        raise typer.Exit(code=1)


@bench_app.command("overhead")
def overhead(
    model: Optional[str] = typer.Option(None, help="Hub id or local folder (default: HuggingFaceTB/SmolLM2-135M-Instruct)."),
    dtype: str = typer.Option("auto", help=DTYPE_HELP),
    max_num_seqs: int = typer.Option(32, "--max-num-seqs", "--seats", min=1, help="Seats of the in-process engine and of each replica."),
    replicas: str = typer.Option("auto", help="Replicas of the served app, or auto (one per CPU core / GPU)."),
    num_requests: int = typer.Option(100, min=1, help="Requests of the seed mix."),
    short: int = typer.Option(20, min=1, help="Output tokens of the short half."),
    long: int = typer.Option(200, min=1, help="Output tokens of the long half."),
    request_rate: float = typer.Option(float("inf"), "--request-rate", help="Served run: requests/s, Poisson arrivals; inf: all at once."),
    threads: Optional[int] = typer.Option(None, min=1, help="torch threads of the in-process run (default: torch's choice)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results as JSON here."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Progress bar on stderr."),
) -> None:
    """The seed mix in-process (LLM.generate), then served over HTTP by a local app: tok/s of both and their ratio."""
    from cluster.bench.overhead import overhead_main

    try:
        overhead_main(
            model=model, dtype=dtype, max_num_seqs=max_num_seqs, replicas=replicas, num_requests=num_requests,
            short=short, long=long, request_rate=request_rate, threads=threads, json_path=json_path, progress=progress,
        )
    except ValueError as exc:
        _fail(str(exc))


@bench_app.command("profile")
def profile(
    model: Optional[str] = typer.Option(None, help="Hub id or local folder (default: HuggingFaceTB/SmolLM2-135M-Instruct)."),
    dtype: str = typer.Option("auto", help=DTYPE_HELP),
    device: str = typer.Option("cpu", help="cpu, cuda or cuda:N."),
    max_num_seqs: int = typer.Option(4, "--max-num-seqs", "--seats", min=1, help="Seats."),
    workload: str = typer.Option("seed-mix", "--workload", "-w", help="seed-mix or input-grounded (the answer repeats or edits a paragraph or function in the prompt)."),
    num_requests: int = typer.Option(100, min=1, help="Requests of the workload."),
    skip: int = typer.Option(20, min=0, help="Steps run before profiling."),
    steps: int = typer.Option(20, min=1, help="Steps profiled."),
    threads: Optional[int] = typer.Option(None, min=1, help="torch threads (default: torch's choice)."),
    attention_backend: str = typer.Option("auto", help="auto, reference, cpu or cuda."),
    compile: bool = typer.Option(True, "--compile/--no-compile", help="torch.compile the model."),
    cuda_graphs: bool = typer.Option(True, "--cuda-graphs/--no-cuda-graphs", help="CUDA: replay decode steps from CUDA graphs (with --compile)."),
    async_scheduling: Optional[bool] = typer.Option(None, "--async-scheduling/--no-async-scheduling", help="Schedule step N+1 while step N runs (continuous policy; the static run stays synchronous; default: on for CUDA, off on CPU)."),
    tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", "-tp", min=1, help="Ranks (processes of --threads threads on CPU, GPUs on CUDA) the model is sharded over."),
    top: int = typer.Option(8, min=1, help="Operators listed."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results as JSON here."),
    constrained_requests: int = typer.Option(0, min=0, help="The first N requests are JSON-constrained (same lengths)."),
    speculative_config: Optional[str] = typer.Option(None, "--speculative-config", help="Speculative decoding, a JSON object of vLLM's keys (method, num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, model, adaptive), e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'; the results report its acceptance (default: off)."),
) -> None:
    """Where a step's time goes: milliseconds per step by phase and by operator (torch profiler)."""
    from cluster.bench.profile import profile_main

    spec = _speculative_config(speculative_config)
    try:
        profile_main(
            model=model, dtype=dtype, device=device, max_num_seqs=max_num_seqs, num_requests=num_requests, skip=skip,
            steps=steps, threads=threads, attention_backend=attention_backend, compile=compile, top=top,
            json_path=json_path, constrained_requests=constrained_requests, cuda_graphs=cuda_graphs,
            async_scheduling=async_scheduling, tensor_parallel_size=tensor_parallel_size, workload=workload,
            speculative_config=spec,
        )
    except ValueError as exc:
        _fail(str(exc))


@bench_app.command("spec")
def spec(
    model: Optional[str] = typer.Option(None, help="Hub id or local folder (default: HuggingFaceTB/SmolLM2-135M-Instruct)."),
    dtype: str = typer.Option("auto", help=DTYPE_HELP),
    device: str = typer.Option("cpu", help="cpu, cuda or cuda:N."),
    seats: str = typer.Option("1,4", help="Comma-separated seat counts (max_num_seqs), one pair of engines each."),
    workloads: str = typer.Option("input-grounded,seed-mix", help="Comma-separated: input-grounded, seed-mix."),
    num_requests: int = typer.Option(8, min=1, help="Requests per workload and seat count (at least twice the seats)."),
    threads: int = typer.Option(1, min=1, help="torch threads."),
    compile: bool = typer.Option(True, "--compile/--no-compile", help="torch.compile the model."),
    speculative_config: str = typer.Option('{"method": "ngram", "num_speculative_tokens": 4}', "--speculative-config", help="The speculative config compared with none (JSON of vLLM's keys)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results as JSON here."),
) -> None:
    """Speculative decoding against the same engine without it: tok/s, ITL, acceptance, step cost by rows."""
    from cluster.bench.spec_bench import WORKLOADS, spec_main

    names = [w.strip() for w in workloads.split(",") if w.strip()]
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown:
        _fail(f"unknown workload(s) {unknown}; choose from {sorted(WORKLOADS)}")
    try:
        seat_counts = [int(s) for s in seats.split(",")]
    except ValueError:
        _fail(f"--seats must be comma-separated integers, got {seats!r}")
    spec_main(
        model=model, dtype=dtype, seats=seat_counts, workloads=names, num_requests=num_requests, threads=threads,
        speculative_config=_speculative_config(speculative_config), compile=compile, json_path=json_path, device=device,
    )


@bench_app.command("lora")
def lora(
    model: Optional[str] = typer.Option(None, help="Hub id or local folder (default: HuggingFaceTB/SmolLM2-135M-Instruct)."),
    dtype: str = typer.Option("auto", help=DTYPE_HELP),
    device: str = typer.Option("cpu", help="cpu, cuda or cuda:N."),
    seats: str = typer.Option("32", help="Comma-separated seat counts (max_num_seqs), one pair of engines each."),
    adapters: int = typer.Option(4, min=1, help="Random adapters mixed with the base model (max_loras)."),
    rank: int = typer.Option(16, min=1, help="Their rank (max_lora_rank)."),
    num_requests: int = typer.Option(64, min=1, help="Requests per run (at least twice the seats)."),
    threads: int = typer.Option(1, min=1, help="torch threads."),
    compile: bool = typer.Option(True, "--compile/--no-compile", help="torch.compile the model."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results as JSON here."),
) -> None:
    """LoRA adapters mixed with base requests against the base model alone (seed mix): tok/s, and a run-time load's cost."""
    from cluster.bench.lora_bench import lora_main

    try:
        seat_counts = [int(s) for s in seats.split(",")]
    except ValueError:
        _fail(f"--seats must be comma-separated integers, got {seats!r}")
    lora_main(
        model=model, dtype=dtype, seats=seat_counts, num_adapters=adapters, rank=rank, num_requests=num_requests,
        threads=threads, compile=compile, json_path=json_path, device=device,
    )


@bench_app.command("lora-routing")
def lora_routing(
    model: Optional[str] = typer.Option(None, help="Hub id or local folder of the base model (default: HuggingFaceTB/SmolLM2-135M-Instruct)."),
    dtype: str = typer.Option("auto", help=DTYPE_HELP),
    replicas: int = typer.Option(2, min=1, help="Replicas of the served app."),
    max_num_seqs: int = typer.Option(8, "--max-num-seqs", "--seats", min=1, help="Seats per replica."),
    max_loras: int = typer.Option(2, min=1, help="LoRA device slots per replica."),
    adapters: int = typer.Option(8, min=1, help="Random adapters made with peft and served."),
    rank: int = typer.Option(8, min=1, help="The adapters' rank."),
    num_requests: int = typer.Option(96, "--num-requests", "-n", min=1, help="Requests per mode."),
    hot: int = typer.Option(2, min=0, help="Hot adapters: together they draw --hot-fraction of the requests."),
    hot_fraction: float = typer.Option(0.6, min=0.0, max=1.0, help="The hot adapters' share of the requests."),
    max_tokens: int = typer.Option(16, min=1, help="Mean output tokens of a request: each draws from half to 1.5 times it (greedy, ignore_eos)."),
    concurrency: int = typer.Option(8, min=1, help="Clients sending requests in a closed loop."),
    seed: int = typer.Option(0, help="Seed of the adapters' weights and of the requests' adapters."),
    modes: List[str] = typer.Option(["aware", "seat-only"], "--mode", help="aware (lora_aware_routing on) and/or seat-only (off); repeat for both (default: both)."),
    compile: bool = typer.Option(True, "--compile/--no-compile", help="torch.compile the model."),
    kv_cache_memory: Optional[str] = typer.Option(None, help="KV cache budget per replica, bytes or with a unit (default: 1 GiB on CPU)."),
    adapter_dir: Optional[Path] = typer.Option(None, help="Write the adapters here and keep them (default: a temporary folder)."),
    timeout: Optional[float] = typer.Option(None, help="Bound on each mode's run in seconds."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results as JSON here."),
) -> None:
    """Adapter-aware vs seat-only routing of LoRA requests on a local app: adapter loads per request, the split over replicas, tok/s."""
    from cluster.bench.lora_routing import lora_routing_main
    from cluster.config import parse_bytes

    try:
        kv_bytes = parse_bytes(kv_cache_memory) if kv_cache_memory is not None else None
    except ValueError as exc:
        _fail(f"--kv-cache-memory: {exc}")
    try:
        lora_routing_main(
            model=model, dtype=dtype, replicas=replicas, max_num_seqs=max_num_seqs, max_loras=max_loras,
            num_adapters=adapters, rank=rank, num_requests=num_requests, hot=hot, hot_fraction=hot_fraction,
            max_tokens=max_tokens, concurrency=concurrency, seed=seed, compile=compile, kv_cache_memory=kv_bytes,
            modes=tuple(modes), adapter_dir=adapter_dir, timeout=timeout, json_path=json_path,
        )
    except ValueError as exc:
        _fail(str(exc))


@bench_app.command("autoscale")
def autoscale(
    model: Optional[str] = typer.Option(None, help="Hub id or local folder (default: HuggingFaceTB/SmolLM2-135M-Instruct)."),
    dtype: str = typer.Option("auto", help=DTYPE_HELP),
    policies: str = typer.Option("carpool,ongoing_requests", help="Comma-separated policies, run in turn: carpool, ongoing_requests."),
    prometheus: Optional[str] = typer.Option(None, help="Path of a prometheus binary: read the Carpool policy's series back from a real Prometheus."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results as JSON here."),
) -> None:
    """Autoscaling on a 2-node Ray cluster: a burst of tiny requests, then a step of long streams, per policy; replicas over time and every request's outcome."""
    import json

    from cluster.bench.autoscale import POLICIES, AutoscaleBench, autoscale_main

    chosen = tuple(p.strip() for p in policies.split(",") if p.strip())
    if not chosen or any(p not in POLICIES for p in chosen):
        _fail(f"--policies takes {', '.join(POLICIES)}, got {policies!r}")
    out = autoscale_main(str(json_path) if json_path else None, AutoscaleBench(model=model, dtype=dtype), chosen, prometheus)
    summary = {
        p: {k: run.get(k) for k in ("deploy_s", "changes", "final_replicas", "record")}
        | {phase: run[phase] for phase in ("tiny", "long")}
        for p, run in out["runs"].items()
    }
    typer.echo(json.dumps(summary, indent=1))


def _speculative_config(text: str | None) -> dict | None:
    """``--speculative-config``'s JSON, validated (every key), or None; a bad one ends the command
    with the problem named (exit status 2)."""
    if text is None:
        return None
    from cluster.config import speculative_config_from_json

    try:
        return speculative_config_from_json(text)
    except ValueError as exc:
        _fail(str(exc))


def _fail(message: str) -> None:
    typer.echo(f"carpool bench: {message}", err=True)
    raise typer.Exit(code=2)


def main(argv: list[str] | None = None) -> None:
    """``python -m cluster.bench ...``."""
    bench_app(args=argv, prog_name="python -m cluster.bench")
