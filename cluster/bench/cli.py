"""The ``bench`` command group (typer): ``carpool bench offline|prefix|serve|overhead|profile|spec|lora|lora-routing|autoscale`` (also ``python -m cluster.bench ...``).

Attach it to the ``carpool`` app with ``app.add_typer(bench_app, name="bench")``. Heavy imports
(torch, transformers, matplotlib) happen only when a command runs.

Every option is a settings field (``cluster/settings_cli.py``): the engine's own settings
(``EngineConfig``: ``--model``, ``--seats``, ``--compile``...) and the server's (``--replicas``,
``--api-key``) with the bench's defaults, and each command's own (``cluster/bench/options.py``).
Each model validates its options before the command runs; a bad value ends the command with exit
status 2 and ``carpool bench: invalid options:`` then one line per field, named with its flag. A
command's ``ValueError`` (bad settings found while it runs) ends it the same way.
"""

from __future__ import annotations

from typing import Any

import typer

from cluster.bench import options as o
from cluster.config import EngineConfig, ServeConfig, parse_speculative_config
from cluster.settings_cli import Given, Opt, command, option, options_of
from replica.serve import log_to_stderr
from router.config import IngressConfig

bench_app = typer.Typer(
    name="bench",
    help="Benchmarks: continuous vs static batching in-process (offline); where a step's time goes (profile); prefix caching on vs off (prefix); load on a live server (serve); in-process vs served on one machine (overhead); speculative decoding on vs off (spec); LoRA adapters mixed with base requests (lora); adapter-aware vs seat-only routing of LoRA requests (lora-routing); the autoscaling policies on 2 nodes (autoscale).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # click's plain help: wraps long option names and defaults instead of cutting them
)


@bench_app.callback()
def _group() -> None:
    """Benchmarks: continuous vs static batching in-process (offline); prefix caching on vs off (prefix); load on a live server (serve)."""
    log_to_stderr()


def _engine(field: str, *decls: str, **settings: Any) -> Opt:
    return option(EngineConfig, field, *decls, to="engine", **settings)


# The engine's own settings, as the bench commands spell them; a command may give its own default.
MODEL = _engine("model", default=None)  # None: the engine's default model
DTYPE, DEVICE, COMPILE = _engine("dtype"), _engine("device"), _engine("compile")
ATTENTION, CUDA_GRAPHS, ASYNC = _engine("attention_backend"), _engine("cuda_graphs"), _engine("async_scheduling")
BATCHED_TOKENS, KV_MEMORY = _engine("max_num_batched_tokens"), _engine("kv_cache_memory")
TP = _engine("tensor_parallel_size", "--tensor-parallel-size", "-tp")
QUANTIZATION = _engine("quantization", "--quantization", "-q")
SPECULATIVE = _engine("speculative_config", "--speculative-config", parse=parse_speculative_config, metavar="<json>",
                      note="A JSON object, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'; the results report its acceptance.")


def _seats(default: int) -> Opt:
    return _engine("max_num_seqs", "--max-num-seqs", "--seats", default=default)


def _fail_bench(message: str) -> None:
    _fail(message)  # defined below; the commands are registered first


@command(bench_app, "offline", [
    MODEL, DTYPE, DEVICE, _seats(4), BATCHED_TOKENS, KV_MEMORY, *options_of(o.OfflineOptions), ATTENTION, COMPILE,
    CUDA_GRAPHS, ASYNC, TP, SPECULATIVE, QUANTIZATION,
], fail=_fail_bench)
def offline(given: Given) -> None:
    """Run a workload through the engine under continuous and static batching; print a table."""
    from cluster.bench.engine.offline import offline_main

    v = given.validated()
    try:
        offline_main(
            v["workload"], model=v["model"], dtype=v["dtype"], device=v["device"], max_num_seqs=v["max_num_seqs"],
            max_num_batched_tokens=v["max_num_batched_tokens"], kv_cache_memory=v["kv_cache_memory"],
            num_requests=v["num_requests"], short=v["short"], long=v["long"], mean_tokens=v["mean_tokens"],
            caps=v["caps"], seed=v["seed"], compare=v["compare"], json_path=v["json_path"], plot_path=v["plot"],
            threads=v["threads"], chat_template=v["chat_template"], progress=v["progress"],
            attention_backend=v["attention_backend"], compile=v["compile"],
            prompt_logprobs_requests=v["prompt_logprobs_requests"], constrained_requests=v["constrained_requests"],
            cuda_graphs=v["cuda_graphs"], async_scheduling=v["async_scheduling"],
            tensor_parallel_size=v["tensor_parallel_size"], speculative_config=v["speculative_config"],
            quantization=v["quantization"],
        )
    except ValueError as exc:
        _fail(str(exc))


@command(bench_app, "prefix", [
    MODEL, DTYPE, DEVICE, _seats(32), BATCHED_TOKENS, KV_MEMORY, *options_of(o.PrefixOptions), ATTENTION, COMPILE,
], fail=_fail_bench)
def prefix(given: Given) -> None:
    """Prefix caching on vs off in-process: TTFT p50/p90, tok/s and hit rate on shared-prefix and multi-turn workloads."""
    from cluster.bench.engine.prefix import prefix_main

    v = given.validated()
    try:
        prefix_main(
            v["workload"], model=v["model"], dtype=v["dtype"], device=v["device"], max_num_seqs=v["max_num_seqs"],
            max_num_batched_tokens=v["max_num_batched_tokens"], kv_cache_memory=v["kv_cache_memory"],
            num_requests=v["num_requests"], system_prompt_len=v["system_prompt_len"], output_len=v["output_len"],
            request_rate=v["request_rate"], num_conversations=v["conversations"], num_turns=v["turns"],
            first_turn_len=v["first_turn_len"], think_time=v["think_time"], settings=v["caching"],
            threads=v["threads"], attention_backend=v["attention_backend"], compile=v["compile"],
            chat_template=v["chat_template"], json_path=v["json_path"], progress=v["progress"],
        )
    except ValueError as exc:
        _fail(str(exc))


@command(bench_app, "serve", [*options_of(o.ServeBenchOptions), option(IngressConfig, "api_key", envvar="CARPOOL_API_KEY")],
         fail=_fail_bench)
def serve(given: Given) -> None:
    """Load a running server with streaming chat requests; print throughput, TTFT, ITL, e2e latency (ms), prefix cache hit rate
    and, when the server speculates, the drafts' acceptance."""
    from cluster.bench.serving.serve import serve_main

    v = given.validated()
    url = v.pop("url")
    try:
        summary = serve_main(url, **v)
    except ValueError as exc:
        _fail(str(exc))
    if summary["errors"]:
        raise typer.Exit(code=1)


@command(bench_app, "overhead", [
    MODEL, DTYPE, _seats(32), option(ServeConfig, "replicas"), *options_of(o.OverheadOptions),
], fail=_fail_bench)
def overhead(given: Given) -> None:
    """The seed mix in-process (LLM.generate), then served over HTTP by a local app: tok/s of both and their ratio."""
    from cluster.bench.serving.overhead import overhead_main

    try:
        overhead_main(**given.validated())
    except ValueError as exc:
        _fail(str(exc))


@command(bench_app, "profile", [
    MODEL, DTYPE, DEVICE, _seats(4), *options_of(o.ProfileOptions), ATTENTION, COMPILE, CUDA_GRAPHS, ASYNC, TP,
    SPECULATIVE, QUANTIZATION,
], fail=_fail_bench)
def profile(given: Given) -> None:
    """Where a step's time goes: milliseconds per step by phase and by operator (torch profiler)."""
    from cluster.bench.engine.profile import profile_main

    try:
        profile_main(**given.validated())
    except ValueError as exc:
        _fail(str(exc))


@command(bench_app, "spec", [
    MODEL, DTYPE, DEVICE, *options_of(o.SpecOptions), COMPILE,
    _engine("speculative_config", "--speculative-config", parse=parse_speculative_config, metavar="<json>",
            default='{"method": "ngram", "num_speculative_tokens": 4}', note="The config compared with none, as JSON."),
], fail=_fail_bench)
def spec(given: Given) -> None:
    """Speculative decoding against the same engine without it: tok/s, ITL, acceptance, step cost by rows."""
    from cluster.bench.engine.spec_bench import spec_main

    spec_main(**given.validated())


@command(bench_app, "lora", [MODEL, DTYPE, DEVICE, *options_of(o.LoRAOptions), COMPILE], fail=_fail_bench)
def lora(given: Given) -> None:
    """LoRA adapters mixed with base requests against the base model alone (seed mix): tok/s, and a run-time load's cost."""
    from cluster.bench.engine.lora_bench import lora_main

    v = given.validated()
    v["num_adapters"] = v.pop("adapters")
    lora_main(**v)


@command(bench_app, "lora-routing", [
    MODEL, DTYPE, option(ServeConfig, "replicas", default=2), _seats(8), _engine("max_loras", default=2),
    *options_of(o.LoRARoutingOptions), COMPILE, KV_MEMORY,
], fail=_fail_bench)
def lora_routing(given: Given) -> None:
    """Adapter-aware vs seat-only routing of LoRA requests on a local app: adapter loads per request, the split over replicas, tok/s."""
    from cluster.bench.serving.lora_routing import lora_routing_main

    v = given.validated()
    v["num_adapters"], v["modes"] = v.pop("adapters"), tuple(v["modes"])
    try:
        lora_routing_main(**v)
    except ValueError as exc:
        _fail(str(exc))


@command(bench_app, "autoscale", [MODEL, DTYPE, *options_of(o.AutoscaleOptions)], fail=_fail_bench)
def autoscale(given: Given) -> None:
    """Autoscaling on a 2-node Ray cluster: a burst of tiny requests, then long streams of one load shape (--shape), per policy; replicas over time and every request's outcome."""
    import json

    from cluster.bench.serving.autoscale import AutoscaleBench, autoscale_main

    v = given.validated()
    json_path = v["json_path"]
    bench = AutoscaleBench(model=v["model"], dtype=v["dtype"], shape=v["shape"])
    out = autoscale_main(str(json_path) if json_path else None, bench, tuple(v["policies"]), v["prometheus"])
    summary = {
        p: {k: run.get(k) for k in ("deploy_s", "changes", "final_replicas", "record")}
        | {phase: run[phase] for phase in ("tiny", "long")}
        for p, run in out["runs"].items()
    }
    typer.echo(json.dumps(summary, indent=1))


def _fail(message: str) -> None:
    typer.echo(f"carpool bench: {message}", err=True)
    raise typer.Exit(code=2)


def main(argv: list[str] | None = None) -> None:
    """``python -m cluster.bench ...``."""
    bench_app(args=argv, prog_name="python -m cluster.bench")
