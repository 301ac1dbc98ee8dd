"""``carpool serve`` as users run it: a config file, its own local Ray cluster, Ctrl-C to stop.

The served process starts a second, private Ray cluster (the session's cluster is idle then);
it is started in its own process group and stopped with SIGINT to the group, as a terminal's
Ctrl-C does.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from cluster.app import SERVE_ENV
from tests.e2e.conftest import cluster_processes, free_port

CARPOOL = str(Path(sys.executable).with_name("carpool"))


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([CARPOOL, *args], capture_output=True, text=True, timeout=timeout)


def test_bad_settings_are_reported_by_field_before_anything_starts(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("replicas: 0\nport: 70000\nengine:\n  max_num_seqs: -1\n  scheduling_policy: fastest\n")
    started = time.monotonic()
    result = run_cli("serve", "--config", str(bad))
    assert result.returncode == 2
    for field in ("replicas", "port", "engine.max_num_seqs", "engine.scheduling_policy"):
        assert field in result.stderr, result.stderr
    assert "starting" not in result.stderr  # nothing started
    assert time.monotonic() - started < 30

    result = run_cli("serve", "--dtype", "float7")
    assert result.returncode == 2 and "dtype must be one of" in result.stderr
    result = run_cli("serve", "--kv-cache-memory", "lots")
    assert result.returncode == 2 and "engine.kv_cache_memory" in result.stderr
    (tmp_path / "broken.json").write_text("{not json")
    result = run_cli("serve", "--config", str(tmp_path / "broken.json"))
    assert result.returncode == 2 and "not valid JSON" in result.stderr
    result = run_cli("serve", "--config", str(tmp_path / "missing.yaml"))
    assert result.returncode == 2 and "cannot read config file" in result.stderr
    result = run_cli("serve", "--tool-chat-template", str(tmp_path / "missing.jinja"))
    assert result.returncode == 2 and "--tool-chat-template" in result.stderr and "does not exist" in result.stderr
    result = run_cli("serve", "--served-model-name", "")
    assert result.returncode == 2 and "served_model_name" in result.stderr


def test_a_port_in_use_or_an_unknown_host_is_refused_before_ray_starts():
    """Serve would fail half a minute later, in some 200 lines of tracebacks that name the port
    only in passing."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = run_cli("serve", "--port", str(port))
    assert result.returncode == 2, result.stderr
    assert f"127.0.0.1:{port} cannot be listened on" in result.stderr and "starting" not in result.stderr
    result = run_cli("serve", "--host", "no-such-host.invalid")
    assert result.returncode == 2 and "host: 'no-such-host.invalid' cannot be resolved" in result.stderr
    result = run_cli("serve", "--host", "192.0.2.1")  # TEST-NET-1: resolves, is no address of this machine
    assert result.returncode == 2 and "host: '192.0.2.1' is not an address of this machine" in result.stderr


def test_an_embedding_model_with_generation_settings_is_refused_before_ray_starts():
    """The pooling engine's refusals (replica/pooling/__init__.py) come before Ray, not as the
    replicas' tracebacks half a minute later."""
    started = time.monotonic()
    result = run_cli("serve", "--model", "sentence-transformers/all-MiniLM-L6-v2", "--scheduling-policy", "priority",
                     "--port", str(free_port()))  # not 8000: a server of the machine's own may hold it
    assert result.returncode != 0, result.stderr
    assert "failed to start: model 'sentence-transformers/all-MiniLM-L6-v2' is an embedding model" in result.stderr
    assert "Traceback" not in result.stderr and "deploying" not in result.stderr, result.stderr[-2000:]
    assert time.monotonic() - started < 30


def test_gguf_quantization_of_a_model_that_is_no_gguf_file_is_refused_before_ray_starts(tmp_path):
    """A folder with ``--quantization gguf``, a ``.gguf`` path with no file and a ``.gguf`` file
    that is not GGUF (with or without the flag) are each named in the last line, before Ray."""
    (tmp_path / "junk.gguf").write_bytes(b"not a model")
    cases = [
        ((str(tmp_path), "--quantization", "gguf"), "quantization gguf needs a GGUF model: a .gguf file"),
        ((str(tmp_path / "missing.gguf"), "--quantization", "gguf"), "no such GGUF file"),
        ((str(tmp_path / "junk.gguf"),), "junk.gguf: not a GGUF file"),
    ]
    for args, message in cases:
        result = run_cli("serve", "--model", *args, "--port", str(free_port()))
        assert result.returncode != 0, result.stderr
        assert "failed to start: " in result.stderr and message in result.stderr.strip().splitlines()[-1], result.stderr[-2000:]
        assert "Traceback" not in result.stderr and "deploying" not in result.stderr, result.stderr[-2000:]


def test_carpool_serve_with_config_file_and_api_key(tmp_path):
    port = free_port()
    config = tmp_path / "carpool.json"
    # CLI options override the file: the file says port 1 (would fail), --port wins.
    config.write_text(json.dumps({"replicas": 1, "port": 1, "engine": {"dtype": "auto", "max_num_seqs": 4, "num_blocks": 64, "max_model_len": 512, "compile": False}}))
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(
        [CARPOOL, "serve", "--config", str(config), "--port", str(port)],  # the API key from the environment
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        # Without the Serve settings of SERVE_ENV, which `carpool serve` must set itself.
        env={**{k: v for k, v in os.environ.items() if k not in SERVE_ENV}, "RAY_USAGE_STATS_ENABLED": "0", "CARPOOL_API_KEY": "sekrit"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 150
        while "is serving" not in (tmp_path / "serve.log").read_text():
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "carpool serve did not come up"
            time.sleep(0.5)
        assert f"{url}/v1" in (tmp_path / "serve.log").read_text()
        # Carpool's own INFO lines reach the console: the app's, and the replica's start line
        # with the dtype `auto` took (Ray forwards a replica's lines a moment later).
        assert "INFO carpool cluster.app: deploying 1 replica(s) of" in (tmp_path / "serve.log").read_text()
        while "ready: model=HuggingFaceTB/SmolLM2-135M-Instruct dtype=" not in (tmp_path / "serve.log").read_text():
            assert time.monotonic() < deadline + 30, "no replica start line: " + (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(0.5)

        assert httpx.get(url + "/health", timeout=10).status_code == 200  # no key needed
        denied = httpx.get(url + "/v1/models", timeout=10)
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
        wrong = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer nope"}, timeout=10)
        assert wrong.status_code == 401

        client = openai.OpenAI(base_url=url + "/v1", api_key="sekrit", max_retries=0, timeout=60)
        reply = client.chat.completions.create(
            model="HuggingFaceTB/SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16, temperature=0,
        )
        assert "Paris" in reply.choices[0].message.content
        # The local cluster's processes got SERVE_ENV from `carpool serve` (its Serve replicas:
        # the processes it started, directly or not, named ray::ServeReplica:...).
        replicas = {f"{p.name()} ({p.pid})": p.environ() for p in cluster_processes(proc.pid, "ray::ServeReplica:")}
        assert len(replicas) == 3, replicas  # the ingress, one LLMReplica and the ResponseStore
        assert all({k: env.get(k) for k in SERVE_ENV} == SERVE_ENV for env in replicas.values()), replicas
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        log.close()
    output = (tmp_path / "serve.log").read_text()
    assert rc == 0, output[-3000:]
    assert "carpool: stopped" in output
    with pytest.raises(httpx.HTTPError):
        httpx.get(url + "/health", timeout=2)
