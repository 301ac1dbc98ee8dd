"""``carpool bench autoscale``: the Carpool autoscaling policy against Serve's ongoing-requests
policy, on a 2-node Ray cluster on this machine.

Setup (:func:`autoscale_main`): a Ray cluster of two nodes (``ray.cluster_utils.Cluster``: a head
and a worker, ``num_cpus`` 1 each, so each holds one replica of 1 CPU), Serve's proxy on the head
on a free port. For each policy, a fresh app of ``max_num_seqs`` seats per replica, autoscaled
between 1 and 2 replicas with short windows (look-back ``look_back_s``, delays and cooldown of a
few seconds), then two phases with the real ``openai`` client (:mod:`cluster.bench.serving.autoscale_load`):

1. **tiny**: ``tiny_clients`` closed-loop clients of ``tiny_tokens``-token requests for
   ``tiny_s`` seconds: many requests in flight, each through in a few steps; the seats never stay
   full with requests waiting. Then ``settle_s`` more seconds for a late decision, and the app is
   brought back to 1 replica.
2. **long**, by ``shape`` (:data:`~cluster.bench.serving.autoscale_load.SHAPES`), streamed
   ``long_tokens``-token requests for ``long_s`` seconds: ``steady``: ``long_clients`` (more
   than the seats) closed-loop clients, the seats fill and requests wait; ``rounds``: rounds of
   ``round_clients`` requests at once, the next when all ended (the tail of each round leaves
   seats empty while its middle keeps requests waiting); ``poisson``: open-loop arrivals at
   ``poisson_load`` times one replica's capacity (its seats ÷ the time one request takes alone,
   measured first); ``tiny``: no long phase. With them, ``tail_clients`` (fewer than one
   replica's seats) that go on until a replica has been removed (at most ``tail_s`` more): a
   scale-down with streams in flight; then until the app is back at 1 replica
   (``down_timeout_s``).

Per policy: the running replica count sampled every 0.5 s (``timeline``), the most replicas in
each phase, the changes (with the requests in flight at each), the requests (every one must complete with all its tokens), each
remaining replica idle with every KV block free (its health check runs the engine's integrity
check), and for the Carpool policy its record (decisions by direction, last reason). With
``prometheus`` (a path to its binary), a real Prometheus scrapes the app's ``/metrics`` every
2 s and the ``carpool:autoscaler_*`` series and the dashboard's autoscaling row are read back
from it.

JSON (``json_path``)::

    {"nodes", "max_num_seqs", "settings": {...}, "runs": {policy: {
        "deploy_s", "timeline": [[t, replicas]], "changes": [[t, from, to, requests in flight]],
        "tiny": {"most_replicas", "requests": {sent, completed, truncated, failed, errors}},
        "long": {"shape", "most_replicas", "back_to_one_s", "requests": {...}, "rounds" | "rate", "request_s"} | None (tiny),
        "final_replicas", "idle": [replica stats], "record": {...} | None, "metrics_text": [lines],
        "reasons": [[t, reason, target, seat utilization, queue wait, demand]] (carpool),
        "prometheus": {"decisions_up", "decisions_down", "last_reason", "dashboard": {title: bool}} | None}}}
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from cluster.bench.serving.autoscale_load import SHAPES, Outcome, Sampler, closed_loop, one_request, poisson, rounds

POLICIES = ("carpool", "ongoing_requests")


@dataclass
class AutoscaleBench:
    """The bench's settings (seconds, requests, tokens); the defaults take about 2 minutes a policy."""

    model: str | None = None
    dtype: str = "auto"
    max_num_seqs: int = 4
    tiny_clients: int = 12
    tiny_tokens: int = 2
    tiny_s: float = 15.0
    settle_s: float = 6.0
    long_clients: int = 8
    long_tokens: int = 192
    long_s: float = 30.0
    tail_clients: int = 2
    tail_s: float = 90.0
    down_timeout_s: float = 90.0
    look_back_s: float = 6.0
    metrics_interval_s: float = 0.5
    upscale_delay_s: float = 2.0
    downscale_delay_s: float = 6.0
    cooldown_s: float = 10.0
    target_queue_wait_s: float = 1.0
    shape: str = "steady"
    round_clients: int = 10
    poisson_load: float = 1.5

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise ValueError(f"shape: unknown load shape {self.shape!r}; choose from {', '.join(SHAPES)}")

    def autoscaling(self, policy: str) -> dict:
        """The app's ``autoscaling`` settings for ``policy``; Serve's policy aims for as many
        ongoing requests per replica as a replica has seats (scale once they are taken)."""
        common = {
            "policy": policy, "min_replicas": 1, "max_replicas": 2, "look_back_period_s": self.look_back_s,
            "metrics_interval_s": self.metrics_interval_s, "upscale_delay_s": self.upscale_delay_s,
            "downscale_delay_s": self.downscale_delay_s, "drain_timeout_s": 120.0,
        }
        if policy == "carpool":
            return {**common, "cooldown_s": self.cooldown_s, "target_queue_wait_s": self.target_queue_wait_s}
        return {**common, "target_ongoing_requests": float(self.max_num_seqs)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replica_actors(app_name: str) -> list:
    """Actor handles of the app's running ``LLMReplica`` replicas (one that dies between the
    listing and its lookup, a replica being removed, is left out)."""
    import ray

    prefix = f"SERVE_REPLICA::{app_name}#LLMReplica#"
    names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix))
    handles = []
    for name in names:
        try:
            handles.append(ray.get_actor(name, namespace="serve"))
        except ValueError:  # "Failed to look up actor": it died after the listing
            continue
    return handles


def wait_for_actors(app_name: str, count: int, timeout_s: float) -> None:
    """Wait until the app has ``count`` replica actors: a replica being removed finishes its
    requests before its actor goes. Raises ``TimeoutError`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while len(replica_actors(app_name)) != count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{app_name}: still {len(replica_actors(app_name))} replica actors after {timeout_s}s")
        time.sleep(0.5)


def idle_and_intact(app_name: str, timeout_s: float = 30.0) -> list[dict]:
    """Wait until every replica of the app is idle (no request running, waiting or streaming,
    every KV block free), then run each one's health check (the engine's integrity check when
    idle). Returns their stats. Raises ``AssertionError`` when they are not idle in time."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        stats = ray.get([a.record_routing_stats.remote() for a in replica_actors(app_name)], timeout=30)
        if stats and all(
            s["num_running"] == 0 and s["num_waiting"] == 0 and s["inflight"] == 0
            and s["num_free_blocks"] == s["num_total_blocks"] for s in stats
        ):
            ray.get([a.check_health.remote() for a in replica_actors(app_name)], timeout=30)
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"replicas of {app_name} not idle after {timeout_s}s: {stats}")
        time.sleep(0.2)


class Prometheus:
    """A real Prometheus (``binary``) scraping ``target`` (host:port) every 2 s, in a temporary folder."""

    def __init__(self, binary: str, target: str) -> None:
        import yaml

        self.folder = tempfile.TemporaryDirectory(prefix="carpool-prom-")
        config = {
            "global": {"scrape_interval": "2s", "scrape_timeout": "2s", "evaluation_interval": "2s"},
            "scrape_configs": [{"job_name": "carpool", "metrics_path": "/metrics", "static_configs": [{"targets": [target]}]}],
        }
        path = Path(self.folder.name)
        (path / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = _free_port()
        self.process = subprocess.Popen(
            [binary, f"--config.file={path / 'prometheus.yml'}", f"--storage.tsdb.path={path / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )

    def query(self, expr: str) -> list[dict]:
        import httpx

        response = httpx.get(f"http://127.0.0.1:{self.port}/api/v1/query", params={"query": expr}, timeout=10)
        response.raise_for_status()
        return response.json()["data"]["result"]

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.folder.cleanup()


def _autoscaler_lines(port: int) -> list[str]:
    """The ``carpool:autoscaler_*`` samples of the app's ``/metrics`` now."""
    import httpx

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    return [line for line in text.splitlines() if line.startswith("carpool:autoscaler_")]


def autoscaling_row_exprs() -> list[tuple[str, str]]:
    """``(title, PromQL)`` of the panels of the shipped dashboard's autoscaling row."""
    dashboard = json.loads((Path(__file__).resolve().parents[3] / "grafana/carpool.json").read_text())
    out, in_row = [], False
    for panel in dashboard["panels"]:
        if panel.get("type") == "row":
            in_row = panel["title"].lower().startswith("autoscaling")
            continue
        if in_row:
            out += [(panel["title"], t["expr"].replace("$__rate_interval", "1m")) for t in panel.get("targets", ())]
    return out


def read_prometheus(prom: Prometheus, app_name: str, timeout_s: float = 20.0) -> dict:
    """The Carpool policy's series as Prometheus holds them; waits up to ``timeout_s`` for a scrape
    that has seen both directions."""
    def value(expr: str) -> float:
        result = prom.query(expr)
        return float(result[0]["value"][1]) if result else 0.0

    app = f'application="{app_name}"'
    deadline = time.monotonic() + timeout_s
    while True:
        up = value(f'carpool:autoscaler_decisions_total{{{app},direction="up"}}')
        down = value(f'carpool:autoscaler_decisions_total{{{app},direction="down"}}')
        if (up and down) or time.monotonic() > deadline:
            break
        time.sleep(1)
    last = [r["metric"]["reason"] for r in prom.query(f"carpool:autoscaler_last_decision{{{app}}} == 1")]
    dashboard = {title: bool(prom.query(expr)) for title, expr in autoscaling_row_exprs()}
    return {"decisions_up": up, "decisions_down": down, "last_reason": last[0] if last else None, "dashboard": dashboard}


async def _watch_record(app_name: str, sampler: Sampler, out: list) -> None:
    """Append ``[t, reason, target, seat utilization, queue wait, demand]`` to ``out`` each time the
    Carpool policy's record shows a new reason or target (polled every 0.5 s)."""
    from router.observability.autoscaler_record import record_actor

    last = None
    while True:
        try:
            decision = (await record_actor(app_name).snapshot.remote())["last"]
        except Exception:  # no decision yet: no record
            decision = None
        if decision is not None and (decision["reason"], decision["target_replicas"]) != last:
            last = (decision["reason"], decision["target_replicas"])
            out.append([round(sampler.now(), 1), decision["reason"], decision["target_replicas"],
                        round(decision["seat_utilization"], 2), round(decision["queue_wait_s"], 2),
                        round(decision.get("demand") or 0.0, 1)])
        await asyncio.sleep(0.5)


async def _long_load(bench: AutoscaleBench, url: str, outcome: Outcome) -> dict:
    """The long phase's main load, by ``bench.shape``; returns what it sent (``rounds``, or the
    Poisson ``rate`` a second and the probe's ``request_s``)."""
    if bench.shape == "rounds":
        return {"rounds": await rounds(url, "model", bench.round_clients, bench.long_s, bench.long_tokens, True, outcome)}
    if bench.shape == "poisson":
        alone = await one_request(url, "model", bench.long_tokens, True, outcome)
        rate = bench.poisson_load * bench.max_num_seqs / alone
        await poisson(url, "model", rate, bench.long_s, bench.long_tokens, True, outcome)
        return {"rate": round(rate, 3), "request_s": round(alone, 2)}
    await closed_loop(url, "model", bench.long_clients, bench.long_s, bench.long_tokens, True, outcome)
    return {}


async def _run_policy(bench: AutoscaleBench, policy: str, port: int, prometheus: str | None) -> dict:
    from ray import serve

    from cluster.app import build_app
    from cluster.config import ServeConfig
    from replica.config.engine_config import EngineConfig
    from router.observability.autoscaler_record import record_actor

    name = f"autoscale-{policy.replace('_', '-')}"
    engine = {"dtype": bench.dtype, "max_num_seqs": bench.max_num_seqs, "kv_cache_memory": 64 << 20, "compile": False}
    if bench.model:
        engine["model"] = bench.model
    config = ServeConfig(
        app_name=name, engine=EngineConfig(**engine), served_model_name="model", direct_ingress=False,
        autoscaling=bench.autoscaling(policy),
    )
    url = f"http://127.0.0.1:{port}/v1"
    started = time.monotonic()
    await asyncio.to_thread(serve.run, build_app(config), name=name, route_prefix="/")
    result: dict = {"deploy_s": round(time.monotonic() - started, 1)}
    prom = Prometheus(prometheus, f"127.0.0.1:{port}") if prometheus else None
    tiny, long = Outcome(), Outcome()
    sampler = Sampler(name, active=lambda: tiny.active + long.active)
    sampling = asyncio.create_task(sampler.run())
    reasons: list = []
    watching = asyncio.create_task(_watch_record(name, sampler, reasons)) if policy == "carpool" else None
    try:
        t0 = sampler.now()
        await closed_loop(url, "model", bench.tiny_clients, bench.tiny_s, bench.tiny_tokens, False, tiny)
        await asyncio.sleep(bench.settle_s)
        result["tiny"] = {"most_replicas": sampler.most(t0), "requests": tiny.as_dict()}
        await sampler.wait_for(1, bench.down_timeout_s)
        t1 = sampler.now()

        def scaled_down() -> bool:  # the tail goes on until a replica has been removed (or tail_s)
            return sampler.now() > t1 + bench.long_s and any(c[2] < c[1] for c in sampler.changes(since=t1))

        result["long"] = None
        if bench.shape != "tiny":
            sent, _ = await asyncio.gather(
                _long_load(bench, url, long),
                closed_loop(url, "model", bench.tail_clients, bench.long_s + bench.tail_s, bench.long_tokens, True, long,
                            stop=scaled_down),
            )
            back = await sampler.wait_for(1, bench.down_timeout_s)
            await asyncio.to_thread(wait_for_actors, name, 1, bench.down_timeout_s)  # the removed one has drained
            result["long"] = {
                "shape": bench.shape, "most_replicas": sampler.most(t1),
                "back_to_one_s": None if back is None else round(back, 1), "requests": long.as_dict(), **sent,
            }
        result["final_replicas"] = sampler.last()
        result["idle"] = await asyncio.to_thread(idle_and_intact, name)
        result["record"] = None
        if policy == "carpool":
            result["record"] = await record_actor(name).snapshot.remote()
            result["metrics_text"] = await asyncio.to_thread(_autoscaler_lines, port)
            if prom is not None:
                result["prometheus"] = await asyncio.to_thread(read_prometheus, prom, name)
    finally:
        sampler.stop()
        await sampling
        if watching is not None:
            watching.cancel()
        if prom is not None:
            prom.close()
        await asyncio.to_thread(serve.delete, name)
    result["timeline"] = sampler.samples
    result["reasons"] = reasons
    result["changes"] = sampler.changes()
    return result


def autoscale_main(json_path: str | None, bench: AutoscaleBench, policies: tuple[str, ...] = POLICIES,
                   prometheus: str | None = None) -> dict:
    """Run the bench (see the module's docstring) for each of ``policies`` in turn on one 2-node
    cluster; write the JSON to ``json_path`` if given and return it."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from cluster.app import apply_serve_env

    apply_serve_env()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        port = _free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        out = {
            "nodes": len([n for n in ray.nodes() if n["Alive"]]),
            "max_num_seqs": bench.max_num_seqs,
            "settings": asdict(bench),
            "runs": {p: asyncio.run(_run_policy(bench, p, port, prometheus)) for p in policies},
        }
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=1))
    return out
