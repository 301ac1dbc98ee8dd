"""``carpool bench lora-routing``: adapter-aware routing against seat-only routing, on a served app
with more adapters than its replicas' device slots.

Setup (:func:`lora_routing_main`): ``num_adapters`` random rank-``rank`` PEFT adapters for the
served model (:func:`cluster.bench.workloads.lora.make_adapters`, in a temporary folder unless
``adapter_dir`` is given), served as ``lora_modules`` by an app of ``replicas`` replicas with
``max_loras`` device slots each. The workload (:func:`cluster.bench.workloads.lora.lora_requests`):
``num_requests`` completions, each naming one adapter, ``hot`` adapters drawing ``hot_fraction``
of them; greedy, each exactly its drawn number of tokens (``ignore_eos``; ``max_tokens`` on
average, from half to one and a half times it), sent by ``concurrency``
clients in a closed loop (each sends its next request when its last one has ended) with the real
``openai`` client.

It runs once per mode on a fresh app (empty slots, a fresh router): ``aware``
(``lora_aware_routing=True``, the default) and ``seat-only`` (``False``). Per mode, from the
server's ``/metrics`` scraped before and after: adapter loads into a device slot
(``carpool:lora_adapter_loads_total``) per request, and the requests each replica finished
(``carpool:request_success_total``); from the client: output tok/s over the run's wall time.

The issue's floor (issue 43), checked on the results (``floor``): with adapter-aware routing,
loads per request at most half of seat-only's, and no replica serving more than 60 % of the
requests.

JSON (``json_path``)::

    {"model", "replicas", "max_num_seqs", "max_loras", "num_adapters", "rank", "num_requests", "hot",
     "hot_fraction", "max_tokens", "concurrency", "seed", "requests_per_adapter": {name: n},
     "requested_output_tokens",
     "modes": {"aware" | "seat-only": {"completed", "errors", "error_messages", "output_tokens",
               "wall_s", "output_tokens_per_s", "adapter_loads", "loads_per_request",
               "requests_per_replica": {replica: n}, "max_replica_share"}},
     "floor": {"loads_per_request_ratio", "loads_met", "split_met", "met"}}
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from cluster.bench.serving.serve_prefix import metrics_url_of, scrape_metrics
from cluster.bench.workloads.lora import LoRARequest, lora_requests, make_adapters

MODES = ("aware", "seat-only")
LOADS_FLOOR = 0.5  # adapter-aware loads per request <= this x seat-only's
SHARE_FLOOR = 0.6  # no replica above this share of the requests (60/40 with 2 replicas)

Deploy = Callable[..., AbstractContextManager]
"""``deploy(config: ServeConfig, replicas: int)``: a context manager that serves the app while it is
open and yields the API's base URL (``http://host:port/v1``)."""


def parse_counters(text: str) -> dict[str, dict[str, float]]:
    """``{replica: {"loads": ..., "requests": ...}}`` from one ``/metrics`` text: each replica's
    ``carpool:lora_adapter_loads_total`` and ``carpool:request_success_total`` (all reasons)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, float]] = {}
    names = {"carpool:lora_adapter_loads_total": "loads", "carpool:request_success_total": "requests"}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = names.get(sample.name)
            if key is not None:
                replica = sample.labels.get("replica", "")
                out.setdefault(replica, {"loads": 0.0, "requests": 0.0})[key] += sample.value
    return out


async def _send_all(url: str, requests: list[LoRARequest], concurrency: int, api_key: str | None,
                    timeout: float | None) -> dict:
    """Send ``requests`` in order from ``concurrency`` closed-loop clients; tokens, errors, wall time."""
    import openai

    queue: asyncio.Queue = asyncio.Queue()
    for r in requests:
        queue.put_nowait(r)
    tokens, errors = [0], []

    async def client_loop(client) -> None:
        while not queue.empty():
            r = queue.get_nowait()
            try:
                reply = await client.completions.create(
                    model=r.adapter, prompt=r.prompt, max_tokens=r.max_tokens, temperature=0, extra_body={"ignore_eos": True},
                )
                tokens[0] += reply.usage.completion_tokens
            except Exception as exc:  # noqa: BLE001 - counted and reported, the run goes on
                errors.append(f"request {r.index} ({r.adapter}): {exc!r}"[:300])

    async with openai.AsyncOpenAI(base_url=url, api_key=api_key or "unused", max_retries=0, timeout=timeout or 600) as client:
        start = time.perf_counter()
        loops = [asyncio.ensure_future(client_loop(client)) for _ in range(concurrency)]
        try:
            await asyncio.wait_for(asyncio.gather(*loops), timeout)
        except asyncio.TimeoutError:
            errors.append(f"the run passed its {timeout} s bound; {queue.qsize()} requests were not sent")
        wall = time.perf_counter() - start
    return {"output_tokens": tokens[0], "errors": errors, "wall_s": wall}


def run_mode(url: str, requests: list[LoRARequest], *, concurrency: int, api_key: str | None = None,
             timeout: float | None = None) -> dict:
    """Run the workload against the app at ``url`` and measure it (module docstring)."""
    metrics_url = metrics_url_of(url)
    before = asyncio.run(scrape_metrics(metrics_url, api_key))
    sent = asyncio.run(_send_all(url, requests, concurrency, api_key, timeout))
    after = asyncio.run(scrape_metrics(metrics_url, api_key))
    if before is None or after is None:
        raise RuntimeError(f"cannot read {metrics_url}: adapter loads and the split need the server's metrics")
    b, a = parse_counters(before), parse_counters(after)
    zero = {"loads": 0.0, "requests": 0.0}
    per_replica = {r: int(a[r]["requests"] - b.get(r, zero)["requests"]) for r in sorted(a)}
    loads = int(sum(a[r]["loads"] - b.get(r, zero)["loads"] for r in a))
    completed = len(requests) - len(sent["errors"])
    total = sum(per_replica.values())
    return {
        "completed": completed, "errors": len(sent["errors"]), "error_messages": sent["errors"][:5],
        "output_tokens": sent["output_tokens"], "wall_s": sent["wall_s"],
        "output_tokens_per_s": sent["output_tokens"] / sent["wall_s"] if sent["wall_s"] > 0 else 0.0,
        "adapter_loads": loads, "loads_per_request": loads / completed if completed else None,
        "requests_per_replica": per_replica,
        "max_replica_share": max(per_replica.values()) / total if total else None,
    }


def floor(modes: dict[str, dict]) -> dict:
    """The issue's floor on the two modes' results (module docstring); ``None`` where a mode is
    missing or a ratio is undefined."""
    aware, seat = modes.get("aware"), modes.get("seat-only")
    ratio = None
    if aware and seat and aware["loads_per_request"] is not None and seat["loads_per_request"]:
        ratio = aware["loads_per_request"] / seat["loads_per_request"]
    loads_met = None if ratio is None else ratio <= LOADS_FLOOR
    split_met = None if not aware or aware["max_replica_share"] is None else aware["max_replica_share"] <= SHARE_FLOOR
    return {"loads_per_request_ratio": ratio, "loads_met": loads_met, "split_met": split_met,
            "met": None if None in (loads_met, split_met) else loads_met and split_met}


@contextmanager
def local_app(config, replicas: int):
    """Serve ``config`` with ``replicas`` replicas on a local Ray cluster (started on first use;
    :func:`cluster.app.run`, which also checks the adapters); yields the base URL, deletes the app."""
    from ray import serve

    from cluster import app as carpool_app

    config = config.model_copy(update={"replicas": replicas})
    url = carpool_app.run(config)
    try:
        yield url
    finally:
        serve.delete(config.app_name)


def format_table(result: dict) -> str:
    """The modes side by side, and the floor."""
    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    lines = [f"{'mode':<10} {'done':>5} {'err':>4} {'loads':>6} {'loads/req':>9} {'tok/s':>8}  split (requests per replica)"]
    for mode, m in result["modes"].items():
        split = " / ".join(str(n) for n in m["requests_per_replica"].values())
        lines.append(f"{mode:<10} {m['completed']:>5} {m['errors']:>4} {m['adapter_loads']:>6} "
                     f"{num(m['loads_per_request'], '.3f'):>9} {m['output_tokens_per_s']:>8.1f}  {split} "
                     f"(max share {num(m['max_replica_share'], '.0%')})")
    f = result["floor"]
    lines.append(f"floor: aware loads/request {num(f['loads_per_request_ratio'], '.2f')} x seat-only's "
                 f"(<= {LOADS_FLOOR}: {f['loads_met']}); split within 60/40: {f['split_met']}")
    return "\n".join(lines)


def lora_routing_main(
    *, model: str | None = None, dtype: str = "auto", replicas: int = 2, max_num_seqs: int = 8, max_loras: int = 2,
    num_adapters: int = 8, rank: int = 8, num_requests: int = 96, hot: int = 2, hot_fraction: float = 0.6,
    max_tokens: int = 16, concurrency: int = 8, seed: int = 0, compile: bool = True, kv_cache_memory: int | None = None,
    max_model_len: int | None = 512, modes: tuple[str, ...] = MODES, adapter_dir: str | Path | None = None,
    timeout: float | None = None, json_path: str | Path | None = None, deploy: Deploy | None = None,
) -> dict:
    """Make the adapters, run each of ``modes`` on a fresh app, print the table; return the results.

    ``deploy`` serves each mode's app (default :func:`local_app`: a local Ray cluster, started here
    and stopped at the end unless one was running). Raises ``ValueError`` for bad settings."""
    from cluster.config import ServeConfig
    from replica.config.engine_config import DEFAULT_MODEL, EngineConfig
    from replica.config.model_files import resolve_model_path

    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise ValueError(f"modes must be among {MODES}, got {list(modes)}")
    requests = lora_requests(num_requests, num_adapters, hot=hot, hot_fraction=hot_fraction, max_tokens=max_tokens, seed=seed)
    model = model or DEFAULT_MODEL
    engine = EngineConfig(
        model=model, dtype=dtype, max_num_seqs=max_num_seqs, compile=compile, enable_lora=True, max_loras=max_loras,
        max_lora_rank=max(16, rank), max_model_len=max_model_len,
        **({"kv_cache_memory": kv_cache_memory} if kv_cache_memory else {}),
    )
    with tempfile.TemporaryDirectory(prefix="carpool-loras-") as scratch:
        folder = Path(adapter_dir) if adapter_dir is not None else Path(scratch)
        print(f"making {num_adapters} rank-{rank} adapters for {model} in {folder} ...", flush=True)
        adapters = make_adapters(resolve_model_path(model), folder, num_adapters, rank=rank, seed=seed)
        results = {}
        started_ray = deploy is None and not _ray_running()
        port = _free_port()  # one port for every mode: a local cluster's ingress keeps the first app's
        try:
            for mode in modes:
                config = ServeConfig(engine=engine, app_name=f"bench-lora-{mode}", lora_modules=adapters,
                                     lora_aware_routing=mode == "aware", port=port)
                with (deploy or local_app)(config, replicas) as url:
                    print(f"{mode}: {num_requests} requests over {num_adapters} adapters, {concurrency} at a time ...", flush=True)
                    results[mode] = run_mode(url, requests, concurrency=concurrency, timeout=timeout)
        finally:
            if started_ray:
                import ray
                from ray import serve

                serve.shutdown()
                ray.shutdown()
    result = {
        "model": model, "replicas": replicas, "max_num_seqs": max_num_seqs, "max_loras": max_loras,
        "num_adapters": num_adapters, "rank": rank, "num_requests": num_requests, "hot": hot,
        "hot_fraction": hot_fraction, "max_tokens": max_tokens, "concurrency": concurrency, "seed": seed,
        "requests_per_adapter": dict(sorted(Counter(r.adapter for r in requests).items())),
        "requested_output_tokens": sum(r.max_tokens for r in requests),
        "modes": results, "floor": floor(results),
    }
    print(format_table(result), flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))
    return result


def _ray_running() -> bool:
    import ray

    return ray.is_initialized()


def _free_port() -> int:
    from cluster.app import free_port

    return free_port("127.0.0.1")
