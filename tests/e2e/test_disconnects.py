"""Clients that go away at every moment of a request, against a real served app.

One replica with 2 seats, so that a third request really waits in the engine's queue, and a
step budget of 8 tokens, so that a long prompt takes many prefill steps before its first token.
After each disconnect the replica must drop the request (counted in
``carpool:requests_aborted_total``, with no more tokens generated for it), keep serving the others, and its ``carpool:num_requests_running`` / ``num_requests_waiting`` /
``kv_cache_usage_perc`` must read 0 once the load is gone. (Disconnects mid-stream and during a
running non-streaming request are in ``test_api.py``.)
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from cluster.config import ServeConfig
from replica.config.engine_config import EngineConfig
from tests.e2e.conftest import ABORT_WITHIN_S

ENGINE = EngineConfig(dtype="auto", max_num_seqs=2, max_num_batched_tokens=8, num_blocks=64, max_model_len=512, compile=False)
CONFIG = ServeConfig(app_name="e2e-disconnects", engine=ENGINE)


@pytest.fixture(scope="module")
def served(deploy):
    with deploy(CONFIG, replicas=1) as served:
        yield served


def assert_gauges_zero(served) -> None:
    m = served.metrics()
    for name in ("carpool:num_requests_running", "carpool:num_requests_waiting", "carpool:kv_cache_usage_perc"):
        assert m[name] == 0.0, (name, m[name])


def wait_for(predicate, timeout_s: float, what: str) -> float:
    """Poll until ``predicate()``; returns the seconds it took."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.01)
    return time.monotonic() - started


class LongStream:
    """A streamed completion that holds its seat (``ignore_eos``); its first event is read.

    The line iterator is kept: dropping a partly read httpx iterator closes the connection.
    """

    def __init__(self, client: httpx.Client, served, max_tokens: int = 400) -> None:
        body = {"model": served.model, "prompt": "Once upon a time", "max_tokens": max_tokens,
                "temperature": 0, "stream": True, "ignore_eos": True}
        request = client.build_request("POST", served.base_url + "/completions", json=body)
        self.response = client.send(request, stream=True)
        assert self.response.status_code == 200
        self.lines = self.response.iter_lines()
        self.next_event()

    def next_event(self) -> str:
        for line in self.lines:
            if line.startswith("data: "):
                return line[6:]
        raise AssertionError("the stream ended")

    def close(self) -> None:
        self.response.close()


def test_disconnect_while_queued(served):
    """Both seats taken: a queued stream and a queued non-streaming request whose clients leave
    are dropped from the waiting queue, and the two running requests carry on."""
    before = served.metrics()["carpool:requests_aborted_total"]
    with httpx.Client(timeout=60) as client:
        seats = [LongStream(client, served), LongStream(client, served)]
        try:
            wait_for(lambda: served.stats()[0]["num_running"] == 2, 10, "both seats taken")
            steps = served.stats()[0]["num_steps"]

            # A queued stream: the response headers arrive, then the client leaves.
            body = {"model": served.model, "prompt": "Hello", "max_tokens": 5, "temperature": 0, "stream": True}
            queued = client.send(client.build_request("POST", served.base_url + "/completions", json=body), stream=True)
            assert queued.status_code == 200
            wait_for(lambda: served.stats()[0]["num_waiting"] == 1, 10, "the stream to be queued")
            queued.close()
            wait_for(lambda: served.stats()[0]["num_waiting"] == 0, ABORT_WITHIN_S, "the queued stream to go")
            s = served.stats()[0]
            assert s["num_running"] == 2, s

            # A queued non-streaming request: the client's read timeout fires while it waits.
            failures = []

            def post() -> None:
                try:
                    httpx.post(served.base_url + "/completions", json={**body, "stream": False},
                               timeout=httpx.Timeout(30, read=2.0))
                    failures.append("the queued request was answered")
                except httpx.ReadTimeout:
                    pass

            thread = threading.Thread(target=post)
            thread.start()
            wait_for(lambda: served.stats()[0]["num_waiting"] == 1, 10, "the request to be queued")
            thread.join(30)
            wait_for(lambda: served.stats()[0]["num_waiting"] == 0, ABORT_WITHIN_S, "the queued request to go")
            assert not failures, failures
            s = served.stats()[0]
            assert s["num_running"] == 2 and s["num_steps"] > steps, s  # the seats kept generating
        finally:
            for r in seats:
                r.close()
    served.wait_idle(timeout_s=ABORT_WITHIN_S)
    m = served.metrics()
    assert m["carpool:requests_aborted_total"] - before == 4  # 2 queued + the 2 seat holders
    assert_gauges_zero(served)


def test_disconnect_before_the_first_token(served):
    """A long prompt prefills 8 tokens per step (~38 steps). The client leaves (1) at once, when
    the response headers arrive, and (2) once the request has a seat and is prefilling: it is
    aborted there and no token is ever generated for it."""
    prompt = " ".join(["word"] * 300)  # about 300 tokens
    body = {"model": served.model, "prompt": prompt, "max_tokens": 20, "temperature": 0, "stream": True}
    url = served.base_url + "/completions"
    with httpx.Client(timeout=60) as client:
        before = served.metrics()
        response = client.send(client.build_request("POST", url, json=body), stream=True)
        assert response.status_code == 200
        response.close()
        served.wait_idle(timeout_s=ABORT_WITHIN_S)
        after = served.metrics()
        # It may have been cancelled before it reached the engine; it never produced a token.
        assert after["carpool:requests_aborted_total"] - before["carpool:requests_aborted_total"] in (0, 1)
        assert after["carpool:generation_tokens_total"] == before["carpool:generation_tokens_total"]
        assert_gauges_zero(served)

        before = after
        response = client.send(client.build_request("POST", url, json=body), stream=True)
        assert response.status_code == 200
        wait_for(lambda: served.stats()[0]["num_running"] == 1, 10, "the request to take a seat")
        response.close()
    served.wait_idle(timeout_s=ABORT_WITHIN_S)
    after = served.metrics()
    assert after["carpool:requests_aborted_total"] - before["carpool:requests_aborted_total"] == 1
    assert after["carpool:generation_tokens_total"] == before["carpool:generation_tokens_total"]
    assert_gauges_zero(served)


def test_disconnect_mid_stream_and_mid_generation_reset_the_gauges(served):
    """Mid-stream (several tokens read) and a non-streaming request cut off while it generates:
    both are aborted, short of their 400 tokens each."""
    before = served.metrics()
    with httpx.Client(timeout=60) as client:
        stream = LongStream(client, served)
        for _ in range(3):
            assert stream.next_event() != "[DONE]"
        assert served.stats()[0]["num_running"] == 1
        stream.close()
    served.wait_idle(timeout_s=ABORT_WITHIN_S)
    assert_gauges_zero(served)

    body = {"model": served.model, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.base_url + "/completions", json=body, timeout=httpx.Timeout(30, read=1.5))
    served.wait_idle(timeout_s=ABORT_WITHIN_S)
    assert_gauges_zero(served)
    after = served.metrics()
    assert after["carpool:requests_aborted_total"] - before["carpool:requests_aborted_total"] == 2
    assert after["carpool:generation_tokens_total"] - before["carpool:generation_tokens_total"] < 2 * 400
