"""API edges taken from public bug reports against OpenAI-compatible servers, end to end (real Ray
Serve, real SmolLM2 in float32, the real ``openai`` client):

* prompt log-probabilities: ``echo`` + ``logprobs`` (how evaluation harnesses score text, often
  with ``max_tokens: 0``) and vLLM's ``prompt_logprobs``, equal to a transformers forward;
* defaults that would break the context limit are capped, explicit values are not;
* parameters that contradict each other get a 400 naming the field.

After every test the replica must be idle with every KV block free (conftest).
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from cluster.config import ServeConfig
from replica.config.engine_config import EngineConfig

MAX_MODEL_LEN = 128
ENGINE = EngineConfig(dtype="float32", max_num_seqs=4, max_model_len=MAX_MODEL_LEN, num_blocks=64, max_num_batched_tokens=16, compile=False)
CONFIG = ServeConfig(app_name="e2e-edges", engine=ENGINE, max_n=4)
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def served(deploy):
    with deploy(CONFIG, replicas=1) as served:
        yield served


@pytest.fixture(scope="module")
def reference():
    """``(ids, logsoftmax [len(ids), V])`` of a transformers fp32 forward over a text's tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from replica.config.model_files import resolve_model_path

    path = resolve_model_path(ENGINE.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    def score(text: str) -> tuple[list[int], torch.Tensor]:
        ids = tokenizer.encode(text)
        with torch.no_grad():
            return ids, model(torch.tensor([ids])).logits[0].log_softmax(-1)

    score.tokenizer = tokenizer
    return score


def post(served, path: str, body: dict) -> httpx.Response:
    return httpx.post(served.base_url + path, json={"model": served.model, **body}, timeout=60)


def streamed(served, path: str, body: dict) -> list[dict]:
    r = post(served, path, {**body, "stream": True})
    assert r.status_code == 200, r.text
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def assert_error(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"], error


# ---- 1. prompt log-probabilities -----------------------------------------------------------------
@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_with_logprobs_scores_the_prompt(served, reference, max_tokens):
    """The evaluation-harness request: prompt tokens first (the first one's entries null), then the
    generated ones; values equal a transformers forward over the same ids (fp32)."""
    ids, ref = reference(PROMPT)
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "echo": True, "logprobs": 1, "temperature": 0}
    r = post(served, "/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    n = len(ids) + max_tokens
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    tok = reference.tokenizer
    assert lp["tokens"][: len(ids)] == [tok.decode([t]) for t in ids]
    for q in range(1, len(ids)):
        assert lp["token_logprobs"][q] == pytest.approx(ref[q - 1, ids[q]].item(), abs=1e-4)
        best = int(ref[q - 1].argmax())
        assert lp["top_logprobs"][q][tok.decode([best])] == pytest.approx(ref[q - 1, best].item(), abs=1e-4)
    assert lp["text_offset"][: len(ids)] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
    assert choice["text"].startswith(PROMPT) and choice["finish_reason"] == "length"
    if max_tokens:  # the generated token: the greedy one after the prompt, at the end of the echoed text
        assert lp["tokens"][-1] == tok.decode([int(ref[-1].argmax())])
        assert lp["text_offset"][-1] == len(PROMPT)
    assert r.json()["usage"]["completion_tokens"] == max_tokens

    events = streamed(served, "/completions", body)
    text = "".join(c["text"] for e in events for c in e["choices"])
    tokens = [t for e in events for c in e["choices"] if c["logprobs"] for t in c["logprobs"]["tokens"]]
    values = [v for e in events for c in e["choices"] if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
    assert (text, tokens) == (choice["text"], lp["tokens"])
    assert values[0] is None and values[1:] == pytest.approx(lp["token_logprobs"][1:], abs=1e-6)


def test_echo_offsets_run_on_where_tokens_split_characters(served):
    """Byte-level tokens of CJK text and emoji decode to partial characters: ``text_offset`` is one
    running count over the token strings (prompt, then output), so it never goes back."""
    body = {"prompt": "日本語😀 ok", "echo": True, "logprobs": 0, "max_tokens": 2, "temperature": 0}
    for lp in [post(served, "/completions", body).json()["choices"][0]["logprobs"]]:
        offsets, tokens = lp["text_offset"], lp["tokens"]
        assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    events = streamed(served, "/completions", body)
    assert [o for e in events for c in e["choices"] if c["logprobs"] for o in c["logprobs"]["text_offset"]] == offsets


def test_a_prompt_filling_the_whole_context_can_be_scored(served):
    prompt = [1000 + i for i in range(MAX_MODEL_LEN)]
    r = post(served, "/completions", {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["logprobs"]["tokens"]) == MAX_MODEL_LEN
    assert_error(post(served, "/completions", {"prompt": prompt, "max_tokens": 1}), "prompt")  # no room for output
    assert_error(post(served, "/completions", {"prompt": prompt + [5], "max_tokens": 0}), "prompt")


def test_vllm_prompt_logprobs_extra(served, reference):
    ids, ref = reference(PROMPT)
    r = post(served, "/completions", {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    entries = r.json()["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for q in range(1, len(ids)):
        entry = entries[q]
        assert entry[str(ids[q])]["logprob"] == pytest.approx(ref[q - 1, ids[q]].item(), abs=1e-4)
        top = ref[q - 1].topk(2).indices.tolist()
        assert {str(t) for t in top} <= set(entry) and len(entry) <= 3
        assert [entry[str(t)]["rank"] for t in top] == [1, 2]
        assert entry[str(ids[q])]["decoded_token"] == reference.tokenizer.decode([ids[q]])

    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}
    body = post(served, "/chat/completions", chat).json()
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
    first = [c for e in streamed(served, "/chat/completions", chat) for c in e["choices"] if "prompt_logprobs" in c]
    assert len(first) == 1 and first[0]["prompt_logprobs"] == body["prompt_logprobs"]
    plain = post(served, "/completions", {"prompt": PROMPT, "max_tokens": 1})
    assert plain.json()["choices"][0]["prompt_logprobs"] is None  # nobody else pays or sees them


def test_prompt_logprobs_leave_batch_mates_unchanged(served):
    """Greedy tokens of plain requests do not change when a scoring request runs beside them."""
    import concurrent.futures as cf

    plain = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    alone = post(served, "/completions", plain).json()["choices"][0]["text"]
    scoring = {"prompt": "word " * 60, "max_tokens": 0, "echo": True, "logprobs": 0}
    with cf.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(post, served, "/completions", plain if i % 2 else scoring) for i in range(4)]
        results = [f.result() for f in futures]
    assert all(r.status_code == 200 for r in results), [r.text for r in results]
    assert [r.json()["choices"][0]["text"] for r in results[1::2]] == [alone, alone]


# ---- 2. defaults capped at the context, explicit values checked -----------------------------------
def test_omitted_max_tokens_is_capped_at_the_context_left(served):
    prompt = [1000 + i for i in range(MAX_MODEL_LEN - 4)]
    r = post(served, "/completions", {"prompt": prompt, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 4
    two = post(served, "/completions", {"prompt": prompt, "n": 2, "ignore_eos": True})
    assert two.status_code == 200 and two.json()["usage"]["completion_tokens"] == 8
    assert_error(post(served, "/completions", {"prompt": prompt, "max_tokens": 16}), "max_tokens")
    # The default grows to min_tokens when it asks for more than 16; beyond the context it is a 400.
    long = post(served, "/completions", {"prompt": "Hi", "min_tokens": 20, "temperature": 0})
    assert long.status_code == 200 and long.json()["usage"]["completion_tokens"] >= 20
    assert_error(post(served, "/completions", {"prompt": prompt, "min_tokens": 5}), "min_tokens")
    chat = [{"role": "user", "content": "word " * 60}]
    r = post(served, "/chat/completions", {"messages": chat, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["total_tokens"] == MAX_MODEL_LEN


# ---- 4. parameters that contradict each other -------------------------------------------------------
CHAT = [{"role": "user", "content": "Hi"}]
CONTRADICTIONS = [
    ("min_tokens over max_tokens", "/completions", {"prompt": "1\n2\n3\n", "max_tokens": 10, "min_tokens": 50}, "min_tokens"),
    ("min_tokens over max_completion_tokens", "/chat/completions", {"messages": CHAT, "max_completion_tokens": 3, "min_tokens": 4}, "min_tokens"),
    ("best_of below n", "/completions", {"prompt": "x", "n": 3, "best_of": 2}, "best_of"),
    ("max_tokens and max_completion_tokens disagree", "/chat/completions", {"messages": CHAT, "max_tokens": 3, "max_completion_tokens": 5}, "max_tokens"),
    ("continue_final_message with add_generation_prompt", "/chat/completions",
     {"messages": [*CHAT, {"role": "assistant", "content": "Hel"}], "continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
    ("continue_final_message with add_generation_prompt left at its default", "/chat/completions",
     {"messages": [*CHAT, {"role": "assistant", "content": "Hel"}], "continue_final_message": True}, "continue_final_message"),
    ("stop_token_ids outside the vocabulary", "/completions", {"prompt": "x", "stop_token_ids": [10**6]}, "stop_token_ids"),
    ("prompt_logprobs above the cap", "/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("max_tokens 0 on chat", "/chat/completions", {"messages": CHAT, "max_tokens": 0}, "max_tokens"),
]


@pytest.mark.parametrize("name,path,body,param", CONTRADICTIONS, ids=[c[0] for c in CONTRADICTIONS])
def test_contradicting_parameters_get_a_400_naming_the_field(served, name, path, body, param):
    assert_error(post(served, path, body), param)


def test_consistent_neighbours_of_those_pairs_are_served(served):
    """The accepted sides of each pair: equal max_tokens names, continue_final_message with
    add_generation_prompt false (after a user turn too, as vLLM)."""
    ok = [
        ("/completions", {"prompt": "1\n2\n3\n", "max_tokens": 10, "min_tokens": 10, "ignore_eos": True}),
        ("/chat/completions", {"messages": CHAT, "max_tokens": 3, "max_completion_tokens": 3}),
        ("/chat/completions", {"messages": [*CHAT, {"role": "assistant", "content": "Hel"}], "continue_final_message": True,
                               "add_generation_prompt": False, "max_tokens": 2}),
        ("/chat/completions", {"messages": CHAT, "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 2}),
        ("/completions", {"prompt": "x", "n": 2, "best_of": 2, "max_tokens": 2}),
    ]
    for path, body in ok:
        r = post(served, path, body)
        assert r.status_code == 200, (body, r.text)
    assert r.json()["usage"]["completion_tokens"] == 4


# ---- 5. chat continuation: vLLM's echo, continue_final_message, add_generation_prompt ---------------
PREFILL = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "My favourite fruit is"}]
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}


@pytest.mark.parametrize("flags", [CONTINUE, {}], ids=["continued", "new turn"])
def test_echo_returns_the_prefilled_turn_first_streamed_and_not(served, flags):
    """With echo, the reply is the prefilled assistant text then what the model adds (the same
    tokens as without echo); streamed, the prefill is each choice's first content delta."""
    client, prefill = served.client, PREFILL[-1]["content"]
    args = {"model": served.model, "messages": PREFILL, "max_tokens": 5, "temperature": 0}
    plain = client.chat.completions.create(**args, extra_body=flags).choices[0].message
    echoed = client.chat.completions.create(**args, extra_body={**flags, "echo": True}).choices[0].message
    assert echoed.role == plain.role == "assistant"
    assert echoed.content == prefill + plain.content
    deltas = [c.choices[0].delta for c in client.chat.completions.create(**args, stream=True, extra_body={**flags, "echo": True}) if c.choices]
    assert deltas[0].role == "assistant" and deltas[1].content == prefill
    assert "".join(d.content or "" for d in deltas) == echoed.content


def test_without_a_generation_prompt_the_reply_takes_the_last_role(served):
    """vLLM's role rule: no generation prompt, so the reply continues (and echoes) the user's turn."""
    r = post(served, "/chat/completions", {"messages": CHAT, **CONTINUE, "echo": True, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["role"] == "user" and message["content"].startswith(CHAT[-1]["content"])
    closed = post(served, "/chat/completions", {"messages": PREFILL, "add_generation_prompt": False, "echo": True, "max_tokens": 2})
    assert closed.status_code == 200 and closed.json()["choices"][0]["message"]["content"].startswith(PREFILL[-1]["content"])
