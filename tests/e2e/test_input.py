"""Bad input and security against a real served app: API key, request caps, body size, and
property-based (hypothesis) bodies on both generation endpoints.

One replica with an API key and small caps. After every test the replica must be idle with every
KV block free (conftest), so no refused or malformed request leaves anything behind.
"""

from __future__ import annotations

import json
import select
import socket
import time

import httpx
import openai
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from cluster.config import ServeConfig
from replica.config.engine_config import EngineConfig

KEY = "test-key-7a"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_CAP = 64 * 1024
CONFIG = ServeConfig(
    app_name="e2e-input",
    engine=EngineConfig(dtype="float32", max_num_seqs=4, max_model_len=128, num_blocks=64, compile=False),
    api_key=KEY,
    max_n=3,
    max_logprobs=5,
    max_stop_sequences=4,
    max_stop_sequence_length=20,
    max_prompts_per_request=4,
    max_choices_per_request=6,
    max_request_body_bytes=BODY_CAP,
)
CHAT = [{"role": "user", "content": "Say hi."}]
FUZZ_EXAMPLES = 100


@pytest.fixture(scope="module")
def served(deploy):
    with deploy(CONFIG, replicas=1) as served:
        served.client = openai.OpenAI(base_url=served.base_url, api_key=KEY, max_retries=0, timeout=60)
        yield served


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["code"], str) and error["code"], error  # never null, whatever the status
    assert isinstance(error["type"], str) and error["type"], error
    if param is not None:
        assert error["param"] == param and param in error["message"], error
    if code is not None:
        assert error["code"] == code, error
    return error


def still_serving(served) -> None:
    reply = served.client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=2, temperature=0)
    assert reply.choices[0].finish_reason == "length"


# ---- API key -------------------------------------------------------------------------------------
ENDPOINTS = [
    ("GET", "/v1/models", None),
    ("GET", f"/v1/models/{CONFIG.model_name}", None),
    ("GET", "/metrics", None),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1, "stream": True}),
    ("GET", "/v1/nowhere", None),
    ("GET", "/docs", None),
]


@pytest.mark.parametrize("method,path,body", ENDPOINTS, ids=[f"{m} {p}" for m, p, _ in ENDPOINTS])
def test_every_endpoint_but_health_needs_the_key(served, method, path, body):
    url = served.root_url + path
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"},
                    {"Authorization": f"Bearer {KEY}x"}):
        r = httpx.request(method, url, json=body, headers=headers, timeout=30)
        assert_openai_error(r, 401, code="invalid_api_key")
        assert r.headers["www-authenticate"] == "Bearer"
    r = httpx.request(method, url, json=body, headers=AUTH, timeout=30)
    assert r.status_code == (404 if path == "/v1/nowhere" else 200), r.text
    assert httpx.get(served.root_url + "/health", timeout=30).status_code == 200  # no key needed
    assert httpx.head(served.root_url + "/health", timeout=30).status_code == 200  # probes may send HEAD


def test_openai_client_with_right_and_wrong_key(served):
    reply = served.client.completions.create(model=served.model, prompt="Hello", max_tokens=2, temperature=0)
    assert reply.usage.completion_tokens == 2
    wrong = openai.OpenAI(base_url=served.base_url, api_key="nope", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model=served.model, messages=CHAT, max_tokens=2, stream=True)
    assert [m.id for m in served.client.models.list().data] == [served.model]


def test_retrieve_one_model(served):
    listed = served.client.models.list().data[0]
    assert served.client.models.retrieve(served.model) == listed
    for other in ("nope", "HuggingFaceTB/other", served.model + "x"):
        with pytest.raises(openai.NotFoundError) as caught:
            served.client.models.retrieve(other)
        assert caught.value.body["code"] == "model_not_found", caught.value.body
        assert other in caught.value.body["message"]
    r = httpx.get(served.root_url + "/v1/models/", headers=AUTH, timeout=30)  # an empty id: the list
    assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == [served.model], r.text
    r = httpx.get(served.root_url + "/v1/models/nope", timeout=30)  # no key
    assert_openai_error(r, 401, code="invalid_api_key")


# ---- configured caps -----------------------------------------------------------------------------
def chat(**kw):
    return {"messages": CHAT, "max_tokens": 2, **kw}


def cmpl(**kw):
    return {"prompt": "x", "max_tokens": 2, **kw}


CAPPED = [
    # (name, path, body, param) with max_n=3, max_logprobs=5, max_stop_sequences=4,
    # max_stop_sequence_length=20, max_prompts_per_request=4, max_choices_per_request=6
    ("n above max_n", "/v1/chat/completions", chat(n=4), "n"),
    ("n zero", "/v1/completions", cmpl(n=0), "n"),
    ("top_logprobs above max_logprobs", "/v1/chat/completions", chat(logprobs=True, top_logprobs=6), "top_logprobs"),
    ("logprobs above max_logprobs", "/v1/completions", cmpl(logprobs=6), "logprobs"),
    ("too many stop strings", "/v1/completions", cmpl(stop=["a", "b", "c", "d", "e"]), "stop"),
    ("stop string too long", "/v1/chat/completions", chat(stop="z" * 21), "stop"),
    ("too many prompts", "/v1/completions", cmpl(prompt=["a", "b", "c", "d", "e"]), "prompt"),
    ("prompts x n above max_choices_per_request", "/v1/completions", cmpl(prompt=["a", "b", "c"], n=3), "prompt"),
    ("empty prompt list", "/v1/completions", cmpl(prompt=[]), "prompt"),
    ("empty message list", "/v1/chat/completions", chat(messages=[]), "messages"),
    ("huge max_tokens", "/v1/chat/completions", chat(max_tokens=10**12), "max_tokens"),
    # Integers JSON allows but a float or an int64 does not hold (they once gave a 500).
    ("max_tokens of 4,300 digits", "/v1/completions", cmpl(max_tokens=int("9" * 4300)), "max_tokens"),
    ("max_completion_tokens past int64", "/v1/chat/completions", chat(max_tokens=None, max_completion_tokens=2**63), "max_completion_tokens"),
    ("logit_bias past a float", "/v1/completions", cmpl(logit_bias={"1": 10**309}), "logit_bias"),
    ("prompt over max_model_len", "/v1/completions", cmpl(prompt="word " * 200, max_tokens=1), "prompt"),
    # Refused by length alone, before tokenizing: max_model_len x the longest token's characters.
    ("prompt of megabyte size", "/v1/completions", cmpl(prompt="ab " * 20_000, max_tokens=1), "prompt"),
    ("message of megabyte size", "/v1/chat/completions", chat(messages=[{"role": "user", "content": "ab " * 20_000}]), "messages.0.content"),
    # A client's own Jinja template would be code run by the server (and could loop for hours).
    ("client chat_template", "/v1/chat/completions",
     chat(chat_template_kwargs={"chat_template": "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"}),
     "chat_template_kwargs"),
    # Arguments the server passes to apply_chat_template itself (they gave a TypeError's text).
    ("chat_template_kwargs setting tokenize", "/v1/chat/completions", chat(chat_template_kwargs={"tokenize": True}), "chat_template_kwargs"),
    ("chat_template_kwargs naming messages", "/v1/chat/completions", chat(chat_template_kwargs={"messages": []}), "chat_template_kwargs"),
    ("chat_template_kwargs naming self", "/v1/chat/completions", chat(chat_template_kwargs={"self": 1}), "chat_template_kwargs"),
    ("chat_template_kwargs setting tools", "/v1/chat/completions", chat(chat_template_kwargs={"tools": []}), "chat_template_kwargs"),
]


@pytest.mark.parametrize("name,path,body,param", CAPPED, ids=[c[0] for c in CAPPED])
def test_caps_give_400_naming_the_field(served, name, path, body, param):
    r = httpx.post(served.root_url + path, json=body, headers=AUTH, timeout=30)
    assert_openai_error(r, 400, param=param)


def test_requests_at_the_caps_are_served(served):
    r = httpx.post(served.root_url + "/v1/completions", headers=AUTH, timeout=60, json=cmpl(
        prompt=["a", "b", "c"], n=2, logprobs=5, stop=["a" * 20, "b", "c", "d"], temperature=0.5, seed=1))
    assert r.status_code == 200, r.text
    assert sorted(c["index"] for c in r.json()["choices"]) == list(range(6))
    stream = served.client.chat.completions.create(
        model=served.model, messages=CHAT, max_tokens=2, n=3, logprobs=True, top_logprobs=5, stream=True)
    finished = [c.choices[0].index for c in stream if c.choices and c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1, 2]


# ---- bodies the JSON parser refuses, and other 4xx without a field's cap -------------------------
UNPARSABLE = [
    # (name, raw body, words the message must contain)
    ("deeply nested", b"[" * 30_000 + b"]" * 30_000, "nested"),  # 60 kB, under the body cap
    ("deeply nested object", b'{"prompt": ' + b'{"a": ' * 5_000 + b"1" + b"}" * 5_001, "nested"),
    ("5000-digit integer", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "digits"),
    ("not UTF-8", b'{"prompt": "\xff\xfe caf\xe9", "max_tokens": 2}', "UTF-8"),
    ("truncated", b'{"prompt": "x", ', "JSON"),
]


@pytest.mark.parametrize("name,raw,words", UNPARSABLE, ids=[c[0] for c in UNPARSABLE])
def test_unparsable_bodies_give_400_with_a_code(served, name, raw, words):
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = httpx.post(served.root_url + path, content=raw, headers={**AUTH, "content-type": "application/json"}, timeout=30)
        error = assert_openai_error(r, 400, code="invalid_json")
        assert words in error["message"] and error["param"] is None, error
    still_serving(served)


OTHER_4XX = [
    # (name, method, path, body, status, param)
    ("stream_options without stream", "POST", "/v1/completions", cmpl(stream_options={"include_usage": True}), 400, "stream_options"),
    ("top_logprobs without logprobs", "POST", "/v1/chat/completions", chat(top_logprobs=2), 400, "top_logprobs"),
    ("body not an object", "POST", "/v1/completions", [1, 2], 400, None),
    ("unknown model", "POST", "/v1/completions", cmpl(model="gpt-4"), 404, "model"),
    ("unknown path", "GET", "/v1/nowhere", None, 404, None),
    ("wrong method", "GET", "/v1/completions", None, 405, None),
]


@pytest.mark.parametrize("name,method,path,body,status,param", OTHER_4XX, ids=[c[0] for c in OTHER_4XX])
def test_every_4xx_has_a_code(served, name, method, path, body, status, param):
    r = httpx.request(method, served.root_url + path, json=body, headers=AUTH, timeout=30)
    assert_openai_error(r, status, param=param)


# ---- content type and body size ------------------------------------------------------------------
def test_wrong_content_type_is_415(served):
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = {**AUTH, "content-type": content_type} if content_type else AUTH
        r = httpx.post(served.root_url + "/v1/completions", content=json.dumps(cmpl()), headers=headers, timeout=30)
        error = assert_openai_error(r, 415, code="unsupported_media_type")
        assert "Content-Type" in error["message"]
    r = httpx.post(served.root_url + "/v1/completions", content=json.dumps(cmpl()),
                   headers={**AUTH, "content-type": "application/json; charset=utf-8"}, timeout=30)
    assert r.status_code == 200, r.text
    still_serving(served)


def raw_request(served, head: str, chunks=(), deadline_s: float = 20.0) -> tuple[int, bytes, int]:
    """Send a request by hand on a socket; keep sending ``chunks`` until the server answers.

    Returns (status, response bytes, body bytes sent). The server must answer within ``deadline_s``.
    """
    port = int(served.root_url.rsplit(":", 1)[1])
    sent = 0
    deadline = time.monotonic() + deadline_s
    chunks = iter(chunks)
    response = b""
    with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
        sock.sendall(head.encode())
        while True:
            assert time.monotonic() < deadline, f"no answer after sending {sent} body bytes"
            readable, _, _ = select.select([sock], [], [], 0.01)
            if readable:
                break
            chunk = next(chunks, None)
            if chunk is None:
                continue
            try:
                sock.sendall(chunk)
                sent += len(chunk)
            except (TimeoutError, BrokenPipeError, ConnectionResetError):
                pass  # the server stopped reading: its answer follows
        try:
            while b"\r\n\r\n" not in response or not response.rstrip().endswith(b"}"):
                data = sock.recv(65536)
                if not data:
                    break
                response += data
        except (TimeoutError, ConnectionResetError):
            pass
    status = int(response.split(b" ", 2)[1])
    return status, response, sent


def test_body_over_the_cap_by_content_length_is_413_unread(served):
    # Declares 1 GB and sends none of it: the answer must come without waiting for the body.
    head = ("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Length: {10**9}\r\n\r\n")
    started = time.monotonic()
    status, response, _ = raw_request(served, head)
    assert status == 413, response
    body = json.loads(response.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "request_too_large" and "max_request_body_bytes" in body["error"]["message"]
    assert time.monotonic() - started < 10
    still_serving(served)


def test_chunked_body_over_the_cap_is_413_while_it_arrives(served):
    # No Content-Length: an endless chunked body; the server must stop it soon after the cap.
    head = ("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY}\r\nTransfer-Encoding: chunked\r\n\r\n")
    piece = b'{"messages": [' + b" " * 8000
    chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"

    def endless():
        while True:
            yield chunk

    status, response, sent = raw_request(served, head, endless())
    assert status == 413, response
    assert b"request_too_large" in response
    assert sent < 200 * BODY_CAP, sent  # refused long before the client gave up
    still_serving(served)


def test_body_under_the_cap_is_read(served):
    headers = {**AUTH, "content-type": "application/json"}
    r = httpx.post(served.root_url + "/v1/completions", headers=headers, timeout=30,
                   content=json.dumps(cmpl(user="u" * (BODY_CAP - 200))))
    assert r.status_code == 200, r.text
    r = httpx.post(served.root_url + "/v1/completions", headers=headers, timeout=30,
                   content=json.dumps(cmpl(user="u" * BODY_CAP)))
    assert_openai_error(r, 413, code="request_too_large")


def test_refusals_are_counted_in_metrics(served):
    httpx.get(served.root_url + "/v1/models", timeout=30)  # 401
    httpx.post(served.root_url + "/v1/completions", json=cmpl(n=9), headers=AUTH, timeout=30)  # 400
    text = httpx.get(served.root_url + "/metrics", headers=AUTH, timeout=30).text
    counts = {}
    for line in text.splitlines():
        if line.startswith("carpool:http_requests_rejected_total{"):
            labels, value = line.rsplit(" ", 1)
            counts[labels] = float(value)
    assert any('status="401"' in k and 'code="invalid_api_key"' in k and v >= 1 for k, v in counts.items()), counts
    assert any('status="400"' in k and 'code="invalid_value"' in k and v >= 1 for k, v in counts.items()), counts
    assert "carpool:num_requests_running{" in text  # the replicas' series are still there


def test_priority_under_the_fcfs_policy(served):
    """The served replicas run the default ``fcfs`` scheduling policy: priority 0 is served, any
    other priority is a 400 naming ``priority`` (vLLM's rule), and so is one that is not an int."""
    for path, body in (("/v1/completions", cmpl), ("/v1/chat/completions", chat)):
        r = httpx.post(served.root_url + path, json=body(priority=0), headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        error = assert_openai_error(httpx.post(served.root_url + path, json=body(priority=-2), headers=AUTH, timeout=30),
                                    400, param="priority", code="invalid_value")
        assert "--scheduling-policy priority" in error["message"], error
        for bad in ("1", 1.5, True):
            assert_openai_error(httpx.post(served.root_url + path, json=body(priority=bad), headers=AUTH, timeout=30),
                                400, param="priority")


# ---- property-based: no input gives a 5xx or a hang ------------------------------------------------
json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12),
)
junk = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}


def bodies(mode: str):
    """Request bodies for both endpoints. ``mode``: ``valid`` (in range, so mostly served),
    ``plausible`` (the right types, often out of range) or ``wild`` (sometimes any JSON at all in a
    field's place)."""

    def field(valid, plausible=None):
        if mode == "valid":
            return valid
        plausible = valid if plausible is None else plausible
        return st.one_of(plausible, plausible, junk) if mode == "wild" else plausible

    tokens = st.integers(1, 3)
    if mode != "valid":
        tokens = st.one_of(tokens, tokens, st.integers(max_value=0), st.integers(min_value=129))
    if mode == "wild":
        tokens = st.one_of(tokens, st.text(max_size=3), st.floats(), st.booleans(), st.lists(st.integers(), max_size=2))
    text = st.text(min_size=1, max_size=40)
    vocab_ids = st.lists(st.integers(0, 49151), min_size=1, max_size=6)
    common = {
        "model": field(st.just(CONFIG.model_name), st.sampled_from([CONFIG.model_name, CONFIG.model_name, "gpt-4", ""])),
        "n": field(st.integers(1, 3), st.integers(-1, 5)),
        "stream": field(st.booleans()),
        "temperature": field(st.floats(0, 2), st.floats(-1, 3)),
        "top_p": field(st.floats(0.01, 1), st.floats(-0.5, 1.5)),
        "top_k": field(st.integers(-1, 100), st.integers(-3, 60000)),
        "min_p": field(st.floats(0, 1), st.floats(-1, 2)),
        "presence_penalty": field(st.floats(-2, 2), st.floats(-3, 3)),
        "frequency_penalty": field(st.floats(-2, 2), st.floats(-3, 3)),
        "repetition_penalty": field(st.floats(0.5, 2), st.floats(-1, 3)),
        "seed": field(st.integers(0, 2**63 - 1), st.integers(-(2**65), 2**65)),
        "stop": field(st.one_of(st.text(min_size=1, max_size=20), st.lists(st.text(min_size=1, max_size=20), max_size=4)),
                      st.one_of(st.text(max_size=25), st.lists(st.text(max_size=25), max_size=6))),
        "stop_token_ids": field(st.lists(st.integers(0, 49151), max_size=4), st.lists(st.integers(-5, 60000), max_size=4)),
        "min_tokens": field(st.integers(0, 3), st.integers(-2, 5)),
        "ignore_eos": field(st.booleans()),
        "skip_special_tokens": field(st.booleans()),
        "include_stop_str_in_output": field(st.booleans()),
        "user": field(st.text(max_size=10)),
        "logit_bias": field(
            st.dictionaries(st.integers(0, 49151).map(str), st.integers(-100, 100), max_size=2),
            st.dictionaries(st.one_of(st.integers(-3, 60000).map(str), st.text(max_size=4)),
                            st.one_of(st.integers(-150, 150), st.floats(-150, 150)), max_size=2),
        ),
        "prompt_logprobs": field(st.integers(0, 5), st.integers(-1, 25)),
    }
    if mode != "valid":
        common["structured_outputs"] = field(
            st.one_of(st.fixed_dictionaries({"choice": st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=3)}),
                      st.fixed_dictionaries({"regex": st.sampled_from(["[a-c]{1,4}", "(x|y)+z?", "[0-9]{2}"])})),
            st.one_of(junk, st.fixed_dictionaries({"regex": st.text(max_size=6)}), st.fixed_dictionaries({"grammar": st.text(max_size=12)})),
        )
        common["guided_json"] = field(st.just({"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"]}), junk)
    if mode != "valid":
        common["stream_options"] = field(st.fixed_dictionaries({"include_usage": field(st.booleans())}))
    completion_extra = {"echo": field(st.booleans()), "logprobs": field(st.integers(0, 5), st.integers(-1, 25))}
    if mode != "valid":
        completion_extra |= {"suffix": field(st.text(max_size=3)), "best_of": field(st.integers(-1, 4))}
    completion = st.fixed_dictionaries(
        {"prompt": field(st.one_of(text, st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=2), vocab_ids),
                         st.one_of(st.text(max_size=40), st.lists(st.text(max_size=10), max_size=5),
                                   st.lists(st.integers(-3, 60000), max_size=6),
                                   st.lists(st.lists(st.integers(-3, 60000), max_size=6), max_size=3))),
         "max_tokens": tokens},
        optional={**common, **completion_extra},
    )
    role = st.sampled_from(["system", "developer", "user", "assistant", "tool", "wizard", ""])
    message = st.fixed_dictionaries(
        {"role": st.just("user") if mode == "valid" else role},
        optional={"content": field(text, st.one_of(st.text(max_size=40), st.none(), st.lists(st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "text", "image_url"]), "text": field(st.text(max_size=10))}), max_size=2))),
            "name": field(st.text(min_size=1, max_size=5, alphabet="abc"), st.text(max_size=5))},
    )
    chat_extra = {"max_completion_tokens": tokens, "add_generation_prompt": field(st.booleans())}
    if mode != "valid":
        chat_extra |= {
            "logprobs": field(st.booleans()), "top_logprobs": field(st.integers(-1, 25)),
            "continue_final_message": field(st.booleans()), "echo": field(st.booleans()),
            "chat_template_kwargs": field(st.dictionaries(st.text(max_size=5), json_leaf, max_size=2)),
            "tools": field(st.just([TOOL]), st.lists(st.one_of(junk, st.just(TOOL)), max_size=2)),
            "tool_choice": field(
                st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "f"}}]),
                st.one_of(junk, st.just({"type": "function", "function": {"name": "g"}})),
            ),
            "response_format": field(
                st.fixed_dictionaries({"type": st.sampled_from(["text", "text", "json_object"])}),
                st.one_of(junk, st.fixed_dictionaries({"type": st.sampled_from(["json_schema", "xml"]), "json_schema": junk})),
            ),
        }
    chat = st.fixed_dictionaries(
        {"messages": field(st.lists(message, min_size=1, max_size=3), st.lists(message, max_size=3)), "max_tokens": tokens},
        optional={**common, **chat_extra},
    )
    return completion, chat


MODES = [bodies(mode) for mode in ("valid", "plausible", "wild")]
COMPLETION = st.one_of(*(m[0] for m in MODES))
CHAT_BODY = st.one_of(*(m[1] for m in MODES))
FUZZ = settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def check_response(r: httpx.Response) -> None:
    """Never a 5xx; a 4xx is an OpenAI error; a 200 is a whole answer (streamed to [DONE])."""
    event(f"status {r.status_code}")
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code != 200:
        assert r.status_code in (400, 404, 413, 415), (r.status_code, r.text)
        assert_openai_error(r, r.status_code)
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", r.text[-500:]
        for data in events[:-1]:
            assert "error" not in json.loads(data), data
    else:
        assert r.json()["choices"], r.text


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served.root_url, headers=AUTH, timeout=30) as client:  # a hang fails
        yield client


@FUZZ
@given(body=COMPLETION)
def test_fuzz_completions(served, http, body):
    check_response(http.post("/v1/completions", content=json.dumps(body), headers={"content-type": "application/json"}))


@FUZZ
@given(body=CHAT_BODY)
def test_fuzz_chat_completions(served, http, body):
    check_response(http.post("/v1/chat/completions", content=json.dumps(body), headers={"content-type": "application/json"}))


@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
       raw=st.one_of(junk.map(lambda v: json.dumps(v).encode()), st.binary(max_size=40),
                     st.floats(allow_nan=True).map(lambda f: json.dumps({"prompt": "x", "temperature": f}).encode())))
def test_fuzz_raw_bodies(served, http, path, raw):
    check_response(http.post(path, content=raw, headers={"content-type": "application/json"}))
