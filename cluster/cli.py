"""The ``carpool`` command (a typer group).

``carpool serve`` starts (or joins) a Ray cluster and serves the OpenAI-compatible API until
Ctrl-C or SIGTERM. Settings come from defaults, then ``--config FILE`` (YAML or JSON, the fields of
:class:`~cluster.config.ServeConfig`), then command-line options; the result is validated before
anything starts, and a bad value is reported by its field name (exit status 2).

More subcommands (e.g. ``carpool bench``) attach to :data:`app` with ``@app.command()`` or
``app.add_typer(sub_app, name="bench")``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, List, Optional

import typer
from pydantic import ValidationError

from cluster.autoscaling import parse_autoscale
from cluster.config import ServeConfig, format_validation_error, parse_bytes, parse_speculative_config
from replica.config.engine_config import DTYPE_HELP
from replica.serve import log_to_stderr
from router.config import parse_lora_module

app = typer.Typer(
    name="carpool",
    help="Carpool: an LLM serving cluster on Ray Serve (continuous batching, paged KV cache).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # click's plain help: wraps long option names and defaults instead of cutting them
)


@app.callback()
def _group() -> None:
    """Carpool: an LLM serving cluster on Ray Serve (continuous batching, paged KV cache)."""
    log_to_stderr()


try:  # ``carpool bench ...`` (cluster/bench; its heavy imports happen only when a command runs)
    from cluster.bench.cli import bench_app
except ImportError:  # pragma: no cover - the bench package is optional
    bench_app = None
if bench_app is not None:
    app.add_typer(bench_app, name="bench")


def load_config_file(path: Path) -> dict[str, Any]:
    """Read a YAML (``.yaml``/``.yml``) or JSON file into a dict. Raises ``ValueError``."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as exc:
        raise ValueError(f"config file {path} is not valid {'YAML' if path.suffix.lower() in ('.yaml', '.yml') else 'JSON'}: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping of settings, got {type(data).__name__}")
    if "applications" in data:
        raise ValueError(
            f"{path} is a Ray Serve config file (it has 'applications'): deploy it with `serve run {path}` "
            "or `serve deploy`; `carpool serve --config` takes Carpool's settings (the `args` of its application)"
        )
    return data


def build_config(
    file: Path | None, overrides: dict[str, Any], engine_overrides: dict[str, Any],
    autoscaling_overrides: dict[str, Any] | None = None,
) -> ServeConfig:
    """Defaults < config file < command-line options; raises ``ValueError``/``ValidationError``.
    ``autoscaling_overrides`` (``--autoscale`` and the policy's flags) are merged into the file's
    ``autoscaling:`` mapping; any of them turns autoscaling on."""
    data = load_config_file(file) if file is not None else {}
    engine = data.get("engine") or {}
    if not isinstance(engine, dict):
        raise ValueError("engine: must be a mapping of engine settings")
    engine = {**engine, **{k: v for k, v in engine_overrides.items() if v is not None}}
    scaling = {k: v for k, v in (autoscaling_overrides or {}).items() if v is not None}
    data = {**data, **{k: v for k, v in overrides.items() if v is not None}}
    if engine:
        data["engine"] = engine
    if scaling:
        given = data.get("autoscaling") or {}
        if not isinstance(given, dict):
            raise ValueError("autoscaling: must be a mapping of autoscaling settings")
        if "max_replicas" not in given and "max_replicas" not in scaling:
            raise ValueError("autoscaling needs its bounds: --autoscale MIN:MAX (or autoscaling.max_replicas in --config)")
        data["autoscaling"] = {**given, **scaling}
    return ServeConfig(**data)


@app.command(context_settings={"allow_extra_args": True})
def serve(
    ctx: typer.Context,
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML or JSON file with ServeConfig fields (engine settings under 'engine:')."),
    model: Optional[str] = typer.Option(None, help="Hub id or local folder of a decoder-only model (default: HuggingFaceTB/SmolLM2-135M-Instruct)."),
    dtype: Optional[str] = typer.Option(None, help=DTYPE_HELP),
    device: Optional[str] = typer.Option(None, help="cpu, cuda or cuda:N (default: cpu)."),
    replicas: Optional[str] = typer.Option(None, help="Replica count, or 'auto': one per GPU (CUDA) or per CPU core (default: auto)."),
    tensor_parallel_size: Optional[int] = typer.Option(None, "--tensor-parallel-size", "-tp", help="GPUs (on CPU: processes of num_cpus_per_replica cores) each replica's model is sharded over; the model's heads must divide by it (default: 1)."),
    max_num_seqs: Optional[int] = typer.Option(None, "--max-num-seqs", "--seats", help="Seats per replica: requests in one batch (default: 32)."),
    kv_cache_memory: Optional[str] = typer.Option(None, help="KV cache budget per replica, bytes or with a unit (1GiB, 512MiB) (default: 1GiB on CPU)."),
    num_blocks: Optional[int] = typer.Option(None, help="KV blocks per replica (overrides --kv-cache-memory)."),
    max_model_len: Optional[int] = typer.Option(None, help="Prompt + output tokens per request at most (default: the model's, capped by the KV pool)."),
    max_num_batched_tokens: Optional[int] = typer.Option(None, help="Token budget of one engine step (default: 512)."),
    scheduling_policy: Optional[str] = typer.Option(None, help="continuous or static (default: continuous)."),
    attention_backend: Optional[str] = typer.Option(None, help="auto (the device's fast kernels), reference, cpu or cuda (default: auto)."),
    compile: Optional[bool] = typer.Option(None, "--compile/--no-compile", help="torch.compile the model (default: on; --no-compile is vLLM's --enforce-eager)."),
    cuda_graphs: Optional[bool] = typer.Option(None, "--cuda-graphs/--no-cuda-graphs", help="CUDA: replay decode steps from captured CUDA graphs (default: on with --compile)."),
    async_scheduling: Optional[bool] = typer.Option(None, "--async-scheduling/--no-async-scheduling", help="Schedule step N+1 while step N runs (vLLM's --async-scheduling; default: on for CUDA, off on CPU)."),
    enable_prefix_caching: Optional[bool] = typer.Option(None, "--enable-prefix-caching/--no-enable-prefix-caching", help="Reuse the KV of cached prompt prefixes (default: on)."),
    speculative_config: Optional[str] = typer.Option(None, "--speculative-config", help="Speculative decoding, a JSON object of vLLM's keys: method (ngram: prompt lookup, or draft_model), num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, model (draft_model's), adaptive; e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'. Replaces a --config file's engine.speculative_config (default: off)."),
    enable_lora: Optional[bool] = typer.Option(None, "--enable-lora/--no-enable-lora", help="Serve LoRA adapters on the base model (default: off; on when --lora-modules or --lora-dir is given)."),
    lora_modules: Optional[List[str]] = typer.Option(None, "--lora-modules", help="LoRA adapters served from the start, as name=path (vLLM's; several after one --lora-modules, or the option repeated); clients send the name as the model. Checked at start; turns --enable-lora on."),
    lora_dir: Optional[List[Path]] = typer.Option(None, "--lora-dir", exists=True, file_okay=False, help="A directory POST /v1/load_lora_adapter may load adapters from (repeatable); a path elsewhere is refused (default: none, runtime loads refused). Turns --enable-lora on."),
    max_loras: Optional[int] = typer.Option(None, help="LoRA adapters on the device at once per replica, least recently used replaced (default: 4)."),
    max_lora_rank: Optional[int] = typer.Option(None, help="Largest LoRA rank served; an adapter of higher rank is refused (default: 16)."),
    max_cpu_loras: Optional[int] = typer.Option(None, help="LoRA adapters kept in host memory per replica (default: --max-loras)."),
    lora_aware_routing: Optional[bool] = typer.Option(None, "--lora-aware-routing/--no-lora-aware-routing", help="Send a LoRA request to a free-seat replica that holds its adapter (default: on; off: adapters ignored)."),
    served_model_name: Optional[str] = typer.Option(None, help="Model id the API reports and accepts (default: --model)."),
    host: Optional[str] = typer.Option(None, help="Bind address (default: 127.0.0.1)."),
    port: Optional[int] = typer.Option(None, help="HTTP port (default: 8000)."),
    api_key: Optional[str] = typer.Option(None, envvar="CARPOOL_API_KEY", help="Require 'Authorization: Bearer KEY' on every endpoint but /health."),
    address: Optional[str] = typer.Option(None, help="Join this Ray cluster ('auto', 'host:6379', 'ray://host:10001') instead of starting a local one."),
    dashboard: Optional[bool] = typer.Option(None, "--dashboard/--no-dashboard", help="Start Ray's dashboard with a local cluster (default: no)."),
    batched_deltas: Optional[bool] = typer.Option(None, "--batched-deltas/--no-batched-deltas", help="Stream tokens from each replica to the ingress over one TCP connection, one message per engine step (default: on; off: one Ray stream item per request per step)."),
    direct_ingress: Optional[bool] = typer.Option(None, "--direct-ingress/--no-direct-ingress", help="With a local cluster and one ingress replica, the ingress serves HTTP on --port itself, skipping Serve's proxy (default: on)."),
    prefix_aware_routing: Optional[bool] = typer.Option(None, "--prefix-aware-routing/--no-prefix-aware-routing", help="Send a prompt to the free-seat replica most likely to hold its prefix in its KV cache (default: on; off: load alone)."),
    tool_call_parser: Optional[str] = typer.Option(None, help="Format of tool calls with tool_choice auto: auto or hermes (<tool_call> blocks) (default: auto)."),
    tool_chat_template: Optional[Path] = typer.Option(None, exists=True, dir_okay=False, readable=True, help="Jinja chat template for chats with tools (default: the model's own if it renders tools, else Carpool's ChatML one)."),
    max_waiting_requests: Optional[int] = typer.Option(None, help="Requests a replica holds beyond its seats; past it: 429 with Retry-After (default: 256)."),
    max_ongoing_requests: Optional[int] = typer.Option(None, help="Serve's cap of requests in flight to one replica (default: 1024; must exceed seats + max waiting)."),
    max_n: Optional[int] = typer.Option(None, help="Largest n (choices per request) (default: 16)."),
    max_logprobs: Optional[int] = typer.Option(None, help="Largest logprobs / top_logprobs, at most 20 (default: 20)."),
    max_stop_sequences: Optional[int] = typer.Option(None, help="Stop strings per request (default: 16)."),
    max_stop_sequence_length: Optional[int] = typer.Option(None, help="Characters per stop string (default: 256)."),
    max_prompts_per_request: Optional[int] = typer.Option(None, help="Prompts in one /v1/completions request (default: 64)."),
    max_choices_per_request: Optional[int] = typer.Option(None, help="Prompts x n of one request (default: 128)."),
    max_request_body_bytes: Optional[str] = typer.Option(None, help="Largest request body, bytes or with a unit (1MiB); larger: 413 (default: 8MiB)."),
    autoscale: Optional[str] = typer.Option(None, "--autoscale", help="Autoscale the replicas between MIN:MAX (e.g. 1:4; 0:4 scales to zero) instead of a fixed --replicas (default: off)."),
    autoscaling_policy: Optional[str] = typer.Option(None, "--autoscaling-policy", help="carpool: on seats taken, queue wait and KV use; ongoing_requests: Serve's, on requests per replica (default: carpool)."),
    target_seat_utilization: Optional[float] = typer.Option(None, help="carpool policy: seat utilization (0-1] that, with queue waits, adds replicas (default: 0.9)."),
    target_queue_wait: Optional[float] = typer.Option(None, "--target-queue-wait", help="carpool policy: seconds the head of a replica's queue waits that, with full seats, adds replicas (default: 1.0)."),
    target_ongoing_requests: Optional[float] = typer.Option(None, help="ongoing_requests policy: requests per replica Serve aims for (default: 32)."),
    shutdown_timeout: Optional[float] = typer.Option(None, "--shutdown-timeout", help="Seconds in-flight requests may take to finish on SIGTERM/Ctrl-C before they are ended (default: 30)."),
) -> None:
    """Serve the OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/models, /health)
    and Prometheus metrics (/metrics)."""
    try:
        kv_bytes = parse_bytes(kv_cache_memory) if kv_cache_memory is not None else None
    except ValueError as exc:
        _fail(f"engine.kv_cache_memory: {exc}")
    try:
        body_bytes = parse_bytes(max_request_body_bytes) if max_request_body_bytes is not None else None
    except ValueError as exc:
        _fail(f"max_request_body_bytes: {exc}")
    try:
        spec = parse_speculative_config(speculative_config) if speculative_config is not None else None
    except ValueError as exc:
        _fail(str(exc))
    try:
        modules = _lora_modules(lora_modules, ctx.args)
    except ValueError as exc:
        _fail(f"--lora-modules: {exc}")
    if api_key is None and os.environ.get("CARPOOL_API_KEY") == "":
        # click reads an empty variable as unset: say so rather than serve without a key.
        _fail("CARPOOL_API_KEY is set but empty: give it a key, or unset it to serve without one")
    engine_overrides = {
        "model": model, "dtype": dtype, "device": device, "max_num_seqs": max_num_seqs,
        "tensor_parallel_size": tensor_parallel_size,
        "kv_cache_memory": kv_bytes, "num_blocks": num_blocks, "max_model_len": max_model_len,
        "max_num_batched_tokens": max_num_batched_tokens, "scheduling_policy": scheduling_policy,
        "attention_backend": attention_backend, "compile": compile, "enable_prefix_caching": enable_prefix_caching,
        "cuda_graphs": cuda_graphs, "async_scheduling": async_scheduling, "speculative_config": spec,
        "enable_lora": enable_lora, "max_loras": max_loras, "max_lora_rank": max_lora_rank,
        "max_cpu_loras": max_cpu_loras,
    }
    overrides = {
        "replicas": replicas, "served_model_name": served_model_name, "host": host, "port": port,
        "api_key": api_key, "address": address, "include_dashboard": dashboard,
        "prefix_aware_routing": prefix_aware_routing, "direct_ingress": direct_ingress,
        "lora_aware_routing": lora_aware_routing, "lora_modules": modules,
        "lora_dirs": [str(d.resolve()) for d in lora_dir] if lora_dir else None,
        "batched_deltas": batched_deltas,
        "tool_call_parser": tool_call_parser,
        "tool_chat_template": str(tool_chat_template.resolve()) if tool_chat_template is not None else None,
        "max_waiting_requests": max_waiting_requests, "max_ongoing_requests": max_ongoing_requests,
        "max_n": max_n, "max_logprobs": max_logprobs, "max_stop_sequences": max_stop_sequences,
        "max_stop_sequence_length": max_stop_sequence_length, "max_prompts_per_request": max_prompts_per_request,
        "max_choices_per_request": max_choices_per_request, "max_request_body_bytes": body_bytes,
        "shutdown_timeout_s": shutdown_timeout,
    }
    try:
        bounds = parse_autoscale(autoscale) if autoscale is not None else {}
    except ValueError as exc:
        _fail(str(exc))
    autoscaling = {
        **bounds, "policy": autoscaling_policy, "target_seat_utilization": target_seat_utilization,
        "target_queue_wait_s": target_queue_wait, "target_ongoing_requests": target_ongoing_requests,
    }
    try:
        cfg = build_config(config, overrides, engine_overrides, autoscaling)
    except ValidationError as exc:
        _fail("invalid settings:\n" + format_validation_error(exc))
    except ValueError as exc:
        _fail(str(exc))
    from cluster.app import listen_problem

    if not cfg.address and (problem := listen_problem(cfg.host, cfg.port)):
        _fail(problem)  # before Ray starts: Serve would fail half a minute later, in a wall of tracebacks
    serve_forever(cfg)


def _missing_adapters(modules: dict[str, str]) -> list[str]:
    """Each ``--lora-modules`` entry whose path is not a folder with an ``adapter_config.json``
    (checked on this node before Ray starts, all at once; a replica then reads each adapter with
    peft and checks it against the model)."""
    import os

    return [
        f"{name}={path}: " + ("not a folder" if not os.path.isdir(path) else "no adapter_config.json in it")
        for name, path in modules.items()
        if not os.path.isfile(os.path.join(path, "adapter_config.json"))
    ]


def _lora_modules(options: list[str] | None, extra: list[str]) -> dict[str, str] | None:
    """``--lora-modules``'s adapters as ``{name: path}`` (None when not given): the option's values
    and the words that follow them (vLLM's ``--lora-modules a=/x b=/y``: click hands the words
    after the first to the command as extra arguments). Relative paths are made absolute here.

    Raises ``ValueError`` for a word that is not ``name=path`` (or its JSON form), a name given
    twice, or extra words without ``--lora-modules``."""
    if not options:
        if extra:
            raise ValueError(f"unexpected arguments {' '.join(extra)!r} (adapters go after --lora-modules)")
        return None
    modules: dict[str, str] = {}
    for word in [*options, *extra]:
        name, path = parse_lora_module(word)
        if name in modules:
            raise ValueError(f"adapter {name!r} is given twice")
        modules[name] = str(Path(path).expanduser().resolve())
    return modules


def _fail(message: str) -> None:
    typer.echo(f"carpool: {message}", err=True)
    raise typer.Exit(code=2)


def serve_forever(cfg: ServeConfig) -> None:
    """Start Ray and the app, print the URL, block until Ctrl-C/SIGTERM, then stop cleanly:
    drain (new requests get 503, those in flight get ``shutdown_timeout_s`` seconds to finish,
    the rest are ended with a 503 error), remove the app, stop Ray if we started it. A second
    Ctrl-C skips the wait."""
    from cluster import app as carpool_app

    if not cfg.address and (problems := _missing_adapters(cfg.lora_modules)):
        _fail("lora_modules: " + "; ".join(problems))  # before Ray; a replica reads and checks the rest once up

    stop = threading.Event()

    def on_signal(signum, frame) -> None:
        stop.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C: stop now

    typer.echo(f"carpool: starting {'Ray (joining ' + cfg.address + ')' if cfg.address else 'a local Ray cluster'} ...", err=True)
    try:
        url = carpool_app.run(cfg)
    except KeyboardInterrupt:
        typer.echo("carpool: interrupted while starting", err=True)
        _shutdown(cfg)
        raise typer.Exit(code=130)
    except Exception as exc:
        typer.echo(f"carpool: failed to start: {exc}", err=True)
        _shutdown(cfg)
        raise typer.Exit(code=1)
    try:  # a second signal may come at any point from here (a supervisor that signals the group)
        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        typer.echo(f"Carpool is serving {cfg.model_name} at {url}  (Ctrl-C stops it)")
        sys.stdout.flush()
        while not stop.wait(0.5):
            pass
        typer.echo(f"carpool: stopping: refusing new requests, up to {cfg.shutdown_timeout_s:g} s for those in flight ...", err=True)
        _drain(cfg)
    except KeyboardInterrupt:
        typer.echo("carpool: interrupted; stopping now", err=True)
    _shutdown(cfg)
    typer.echo("carpool: stopped", err=True)


def _drain(cfg: ServeConfig) -> None:
    """Ask every ingress replica to drain (see ``OpenAIIngress.drain``) and wait for them."""
    from ray import serve

    from cluster.app import INGRESS_DEPLOYMENT

    try:
        handle = serve.get_deployment_handle(INGRESS_DEPLOYMENT, app_name=cfg.app_name)
        results = handle.broadcast("drain", cfg.shutdown_timeout_s).results(timeout_s=cfg.shutdown_timeout_s + 30)
    except Exception as exc:  # the app is already gone or broken: nothing left to drain
        typer.echo(f"carpool: draining failed: {exc!r}", err=True)
        return
    for r in results:
        if isinstance(r, dict):
            typer.echo(f"carpool: {r['finished']} of {r['in_flight']} requests in flight finished, {r['ended']} ended", err=True)


def _shutdown(cfg: ServeConfig) -> None:
    import ray
    from ray import serve

    if not ray.is_initialized():
        return
    try:
        if cfg.address:  # a shared cluster: remove only our application
            serve.delete(cfg.app_name)
        else:
            serve.shutdown()
    except Exception as exc:  # already gone
        typer.echo(f"carpool: during shutdown: {exc}", err=True)
    ray.shutdown()


def main() -> None:
    """Console-script entry point (``carpool``)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray's log dedup prints the first of worker lines that differ only in words with digits (each
    # replica's "ready" line) and holds back or drops the others: show each replica's.
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    app()


if __name__ == "__main__":
    main()
