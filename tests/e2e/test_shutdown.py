"""``carpool serve`` on SIGTERM: stop admitting, let in-flight requests finish within the grace
period (``--shutdown-timeout``), end the rest cleanly, exit 0.

A real subprocess with its own local Ray cluster on a free 127.0.0.1 port. SIGTERM goes to the
``carpool`` process alone, as Kubernetes or systemd send it (Ctrl-C in a terminal signals the
whole process group, Ray's own processes included).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from contextlib import contextmanager

import httpx

from tests.e2e.conftest import cluster_processes, free_port
from tests.e2e.test_cli import CARPOOL

GRACE_S = 8


@contextmanager
def carpool_serve(tmp_path, *args: str):
    """Start ``carpool serve --port <free port> *args`` in its own session and wait until it
    serves; yields ``(process, base URL, log path)``. On exit, whatever is still running of it is
    killed (the process group: carpool and its local Ray cluster)."""
    port = free_port()
    log_path = tmp_path / "serve.log"
    log = open(log_path, "w+")
    proc = subprocess.Popen(
        [CARPOOL, "serve", "--port", str(port), "--no-compile", *args],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
    )
    try:
        deadline = time.monotonic() + 150
        while "is serving" not in log_path.read_text():
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "carpool serve did not come up"
            time.sleep(0.5)
        yield proc, f"http://127.0.0.1:{port}", log_path
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def stream(url: str, max_tokens: int, out: dict, first_event: threading.Event) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    events = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first_event.set()
    except Exception as exc:
        out["exception"] = repr(exc)
    out["events"] = events
    out["ended"] = time.monotonic()
    first_event.set()


def test_sigterm_drains_then_exits(tmp_path):
    with carpool_serve(
        tmp_path, "--replicas", "1", "--dtype", "auto", "--seats", "4", "--num-blocks", "128",
        "--max-model-len", "1024", "--shutdown-timeout", str(GRACE_S),
    ) as (proc, url, log_path):
        short, long_ = {}, {}
        short_started, long_started = threading.Event(), threading.Event()
        threads = [
            # Ends within the grace: 12 tokens take about 3 s on a slow 2-core CPU in float32 (40
            # did not finish within 8 s on CI's AVX2 machine).
            threading.Thread(target=stream, args=(url, 12, short, short_started), daemon=True),
            threading.Thread(target=stream, args=(url, 900, long_, long_started), daemon=True),  # cut off by it
        ]
        for t in threads:
            t.start()
        assert short_started.wait(60) and long_started.wait(60)
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()

        # New requests are refused with a 503 once draining has begun (a moment after the signal).
        refused = None
        while refused is None and time.monotonic() - signalled < 10:
            r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
            if r.status_code == 503:
                refused = r
            else:
                assert r.status_code == 200, r.text
                time.sleep(0.1)
        assert refused is not None, "new requests were still admitted 10 s after SIGTERM"
        assert refused.json()["error"]["code"] == "shutting_down"
        assert httpx.get(url + "/health", timeout=10).status_code == 503

        for t in threads:
            t.join(GRACE_S + 30)
        rc = proc.wait(timeout=GRACE_S + 60)
        exited = time.monotonic() - signalled
    output = log_path.read_text()
    assert rc == 0, output[-3000:]
    assert "carpool: stopped" in output
    # The short stream (and any probe that was in flight) finished, the long one was ended.
    assert re.search(r"carpool: \d+ of \d+ requests in flight finished, 1 ended", output), output[-3000:]

    # The short stream finished normally within the grace period.
    assert short["status"] == 200 and "exception" not in short, short
    assert short["events"][-1] == "[DONE]"
    assert json.loads(short["events"][-2])["choices"][0]["finish_reason"] == "length"
    # The long one was ended cleanly at the end of the grace period: an error event, then [DONE].
    assert long_["status"] == 200 and "exception" not in long_, long_
    assert long_["events"][-1] == "[DONE]"
    error = json.loads(long_["events"][-2])["error"]
    assert error["code"] == "unavailable" and "shutting down" in error["message"]
    assert GRACE_S - 1 < long_["ended"] - signalled < GRACE_S + 15
    assert exited < GRACE_S + 60
    print(f"\nSIGTERM: exited with 0 after {exited:.1f} s; long stream ended {long_['ended'] - signalled:.1f} s after the signal")


def _outcome(url: str, body: dict, out: list) -> None:
    """Append ``("status", code, retry_after, error or None)`` or ``("event", error or None)`` for
    a stream that ended with ``[DONE]``, or ``("exception", repr)``."""
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            if not body.get("stream") or r.status_code != 200:
                r.read()
                error = r.json().get("error") if r.headers.get("content-type", "").startswith("application/json") else r.text
                out.append(("status", r.status_code, r.headers.get("retry-after"), error if r.status_code != 200 else None))
                return
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        out.append(("event", json.loads(events[-2]).get("error")))
    except Exception as exc:
        out.append(("exception", repr(exc)))


def test_sigterm_while_requests_wait_for_a_dead_replica_answers_every_one(tmp_path):
    """The only replica is killed with requests waiting on it; the ingress starts them again
    (retry), and new requests arrive before it sees the replica gone: all of them wait in Serve's
    queue for a replacement. SIGTERM then. Draining must not fail (no replica to tell to abort)
    and every such request gets a JSON 503 at the end of the grace period, not a dropped
    connection when the server stops."""
    grace = 4
    with carpool_serve(
        tmp_path, "--replicas", "1", "--dtype", "float32", "--seats", "1", "--num-blocks", "64",
        "--max-model-len", "512", "--shutdown-timeout", str(grace),
    ) as (proc, url, log_path):
        body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
        outcomes: list = []
        threads = [threading.Thread(target=_outcome, args=(url, {**body, "stream": True}, outcomes), daemon=True)]
        threads[0].start()
        time.sleep(1.0)  # the long stream takes the one seat; two more wait behind it
        for extra in ({"stream": True, "max_tokens": 8}, {"max_tokens": 8}):
            threads.append(threading.Thread(target=_outcome, args=(url, {**body, **extra}, outcomes), daemon=True))
            threads[-1].start()
        deadline = time.monotonic() + 60
        while "num_requests_waiting" not in (m := httpx.get(url + "/metrics", timeout=30).text) or not re.search(
            r"^carpool:num_requests_waiting\{[^}]*\} 2\.0$", m, re.M
        ):
            assert time.monotonic() < deadline, "the two requests never waited on the replica"
            time.sleep(0.2)
        pids = [p.pid for p in cluster_processes(proc.pid, "LLMReplica")]
        assert len(pids) == 1, pids
        os.kill(pids[0], signal.SIGKILL)
        for extra in ({"stream": True, "max_tokens": 8}, {"max_tokens": 8}):  # before the ingress sees it
            threads.append(threading.Thread(target=_outcome, args=(url, {**body, **extra}, outcomes), daemon=True))
            threads[-1].start()
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(grace + 60)
        assert not any(t.is_alive() for t in threads), "a request hung"
        rc = proc.wait(timeout=grace + 60)
    output = log_path.read_text()
    assert rc == 0 and "draining failed" not in output, output[-3000:]
    assert len(outcomes) == 5, outcomes
    for o in outcomes:
        assert o[0] != "exception", outcomes
        if o[0] == "status":  # refused or ended before the stream began: JSON 503 with Retry-After
            assert o[1] == 503 and o[2] is not None and o[3]["code"] in ("unavailable", "shutting_down"), outcomes
        else:  # the stream had begun: an error event, then [DONE]
            assert o[1] is not None and o[1]["code"] == "unavailable", outcomes
    print(f"\nSIGTERM with requests waiting for a dead replica: {outcomes}")
