"""End-to-end fixtures: one local Ray cluster per test process (each pytest-xdist worker has its
own), one Serve app per module.

* ``ray_cluster``: ``ray.init`` with 2 CPUs and no dashboard; each app's ingress serves HTTP on
  a free port of 127.0.0.1 (from 30000 up; 100 ports per xdist worker) itself, as under ``carpool serve`` (Serve's direct ingress; Serve's
  proxy listens on another port, unused). Package scope: one cluster for the whole e2e suite in a session, shut down when
  the suite ends, so that it does not idle through the other test directories.
* ``deploy(config, replicas)``: deploys ``cluster.app.build_app(config)`` as an app
  and returns a :class:`Served` (base URL, ``openai`` client, per-replica stats); without a
  ``response_store`` setting in the config, the app stores no responses (one replica fewer). Modules wrap it
  in a module-scoped ``served`` fixture and the app is deleted when the module ends.
* After every test that uses ``served``: every replica must come back to 0 running, 0 waiting,
  all KV blocks free, and pass the engine's ``check_integrity()``.

Replica stats are read straight from each replica actor (``record_routing_stats``, the hook that
Serve's controller polls), so a test sees every replica, not whichever one a handle picks.

Engines: ``test_api`` serves with the default (compiled) engine, at the tests' KV budget
(``tests.helpers.KV_CACHE_MEMORY``), so that its compile is the one the engine tests' compiled
SmolLM2 loads from the compile cache; the other modules pass ``compile=False`` (``--no-compile``),
which runs the same engine eagerly and starts faster, since what they test is the serving around it
(docs/development.md, "The suite's time").
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

# A hang guard, not a speed check: the suite runs on two pytest-xdist workers, so an e2e test
# shares the 2 cores with another test file all along.
E2E_TIMEOUT_S = 420

# How long a disconnected request may take to leave the replica. Also a hang guard, not a speed
# check: an abort crosses Serve's proxy, the ingress and the replica, three processes that share
# the 2 cores with the other xdist worker (a cold compile there starved one for over 1.5 s in CI).
# The disconnect tests show that the request was aborted by counting it
# (``carpool:requests_aborted_total``) and the tokens it was not given.
ABORT_WITHIN_S = 10.0


def pytest_configure(config):
    # Ray Serve's own pydantic models use deprecated Field arguments; not ours to fix.
    config.addinivalue_line("filterwarnings", "ignore:Using extra keyword arguments on `Field`:DeprecationWarning")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/e2e/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.timeout(E2E_TIMEOUT_S))


def run_script(module: str, out_path: Path, timeout_s: float) -> None:
    """Run ``python -m module out_path`` in a session of its own (its own Ray cluster: no
    ``RAY_ADDRESS`` passed on), failing the test with its output if it runs over ``timeout_s``
    (its whole session is killed: its Ray nodes too) or exits non-zero."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen(
        [sys.executable, "-m", module, str(out_path)], cwd=Path(__file__).resolve().parents[2], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        output, _ = proc.communicate()
        pytest.fail(f"{module} took over {timeout_s}s:\n{output[-6000:]}")
    assert proc.returncode == 0, output[-6000:]


def free_port() -> int:
    """A free port of 127.0.0.1 that the OS picks (:func:`cluster.app.free_port`)."""
    from cluster.app import free_port as free_port_of

    return free_port_of("127.0.0.1")


def free_port_outside_ephemeral_range(start: int = 30000, stop: int = 31000) -> int:
    """A free port of 127.0.0.1 in ``[start, stop)``: below Linux's ephemeral range (32768 and up),
    where :func:`free_port` never lands, and Serve's default direct-ingress range. The e2e apps'
    ingress port is free while no app is deployed; a port there could be handed to another test's
    server meanwhile, and Serve blocks a port it once failed to bind."""
    for port in range(start, stop):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{start}, {stop})")


class Served:
    """A deployed Carpool app as a test sees it."""

    def __init__(self, name: str, port: int, config) -> None:
        import openai

        self.name = name
        self.config = config
        self.base_url = f"http://127.0.0.1:{port}/v1"
        self.root_url = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=self.base_url, api_key="unused", max_retries=0, timeout=120)
        self.model = config.model_name

    def replica_actors(self) -> list:
        """Actor handles of this app's LLMReplica replicas (Serve names them SERVE_REPLICA::app#LLMReplica#id)."""
        import ray

        prefix = f"SERVE_REPLICA::{self.name}#LLMReplica#"
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
        return [ray.get_actor(n, namespace="serve") for n in sorted(names)]

    def stats(self) -> list[dict]:
        """Fresh stats of every replica (see ``LLMReplica.record_routing_stats``)."""
        import ray

        return ray.get([a.record_routing_stats.remote() for a in self.replica_actors()], timeout=30)

    def metrics(self) -> dict[str, float]:
        """``carpool:*`` samples of ``/metrics`` summed over replicas and labels (counters under
        their ``_total`` name)."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.root_url + "/metrics", timeout=30).text
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
        return values

    def wait_idle(self, timeout_s: float = 5.0) -> list[dict]:
        """Poll until every replica shows 0 running, 0 waiting, all blocks free; return the stats."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            if all(_idle(s) for s in stats):
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"replicas not idle after {timeout_s}s: {stats}")
            time.sleep(0.02)

    def assert_idle_and_intact(self) -> None:
        """Idle (see :meth:`wait_idle`), then each replica's health check runs the engine's
        ``check_integrity()`` (it does so whenever the replica is idle)."""
        import ray

        stats = self.wait_idle()
        assert stats, "no replicas found"
        ray.get([a.check_health.remote() for a in self.replica_actors()], timeout=30)


def _idle(s: dict) -> bool:
    return (
        s["num_running"] == 0
        and s["num_waiting"] == 0
        and s["num_free_blocks"] == s["num_total_blocks"]
        and s["inflight"] == 0
    )


def process_environ(pid: int) -> dict[str, str]:
    """The environment of process ``pid`` (psutil; raises ``psutil.Error`` if it is gone)."""
    import psutil

    return psutil.Process(pid).environ()


def cluster_processes(carpool_pid: int, title: str) -> list:
    """The ``psutil.Process``es among the descendants of ``carpool_pid`` (a ``carpool serve`` and
    the local Ray cluster it started) whose command line contains ``title``, such as
    ``ray::ServeReplica:`` or ``LLMReplica``; processes that end meanwhile are left out."""
    import psutil

    found = []
    for p in psutil.Process(carpool_pid).children(recursive=True):
        try:
            if title in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:
            pass
    return found


@pytest.fixture(scope="package")
def ray_cluster():
    """One local Ray cluster (2 CPUs) whose apps' ingress serves 127.0.0.1:<free port> itself
    (:func:`cluster.app.direct_ingress_env`); yields that port."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    from cluster.app import apply_serve_env, direct_ingress_env

    apply_serve_env()  # the Serve settings `carpool serve` uses
    # Under pytest-xdist each worker has its own cluster: its own 100 ports, so that two workers
    # never pick the same free port at once.
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    port = free_port_outside_ephemeral_range(30000 + 100 * worker, 30100 + 100 * worker)
    # As under `carpool serve`: each app's one ingress replica serves `port` itself (Serve's direct
    # ingress). The cluster's processes take the settings at its start; this process and the
    # subprocesses that tests start keep their own environment.
    saved = dict(os.environ)
    os.environ.update(direct_ingress_env(port))
    try:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    try:
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="package")
def deploy(ray_cluster):
    """``with deploy(config, replicas=N) as served:`` deploys the app, deletes it on exit."""
    from ray import serve

    from cluster.app import build_app

    @contextmanager
    def _deploy(config, replicas: int):
        name = config.app_name
        if not {"response_store", "response_store_max_bytes"} & config.model_fields_set:
            # No ResponseStore replica for an app whose tests do not store responses (router/responses/).
            config = config.model_copy(update={"response_store": "none"})
        serve.run(build_app(config, replicas), name=name, route_prefix="/")
        try:
            yield Served(name, ray_cluster, config)
        finally:
            serve.delete(name)

    return _deploy


@pytest.fixture(autouse=True)
def _replicas_idle_after_test(request):
    """After each test that uses ``served``: replicas idle, blocks free, integrity holds."""
    yield
    if "served" in request.fixturenames:
        served = request.getfixturevalue("served")
        served.assert_idle_and_intact()
