"""``POST /v1/embeddings`` through the real ``openai`` client against a served SmolLM2 (one eager
replica; docs/embeddings.md): float and base64 encodings, token-id inputs, a batch of 64 inputs in
order, the usage, the metrics, and OpenAI-style 400s for bad input. The vectors' fidelity to
transformers is checked at the engine level (``tests/engine/test_embeddings.py``). After every
test the replica is idle with every KV block free (conftest).
"""

from __future__ import annotations

import base64
import struct

import openai
import pytest
import torch

from cluster.config import ServeConfig
from replica.config.engine_config import EngineConfig

pytestmark = pytest.mark.slow

CONFIG = ServeConfig(
    app_name="e2e-embeddings",
    engine=EngineConfig(dtype="float32", max_num_seqs=8, max_model_len=256, num_blocks=128, compile=False),
    max_waiting_requests=24,  # a replica holds 32 requests: 64 inputs run in two waves
)
TEXTS = ["The capital of France is Paris.", "A cat sat on the mat.", "def add(a, b): return a + b"]


@pytest.fixture(scope="module")
def served(deploy):
    with deploy(CONFIG, replicas=1) as served:
        yield served


def cosine(a, b) -> float:
    return float(torch.nn.functional.cosine_similarity(torch.tensor(a), torch.tensor(b), dim=0))


def test_float_and_base64_encodings_and_token_inputs(served, smollm2_tokenizer):
    """The client's default (it asks for base64 and decodes it) equals ``encoding_format="float"``
    value for value; an explicit base64 string is the little-endian float32 bytes; token-id inputs
    (a list of lists, and one flat list) give the vectors of the same texts; usage counts the tokens."""
    client = served.client
    floats = client.embeddings.create(model=served.model, input=TEXTS, encoding_format="float")
    assert floats.object == "list" and floats.model == served.model
    assert [d.index for d in floats.data] == [0, 1, 2] and all(d.object == "embedding" for d in floats.data)
    vectors = [d.embedding for d in floats.data]
    assert all(len(v) == 576 and abs(sum(x * x for x in v) - 1) < 1e-4 for v in vectors)
    assert cosine(vectors[0], vectors[1]) < 0.99  # distinct inputs, distinct vectors
    ids = [smollm2_tokenizer.encode(t) for t in TEXTS]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))

    decoded = client.embeddings.create(model=served.model, input=TEXTS)  # base64 on the wire
    assert [d.embedding for d in decoded.data] == vectors

    raw = client.embeddings.create(model=served.model, input=TEXTS[0], encoding_format="base64")
    encoded = raw.data[0].embedding
    assert isinstance(encoded, str)
    assert list(struct.unpack("<576f", base64.b64decode(encoded))) == vectors[0]

    by_ids = client.embeddings.create(model=served.model, input=ids, encoding_format="float")
    assert [d.embedding for d in by_ids.data] == vectors
    flat = client.embeddings.create(model=served.model, input=ids[2], encoding_format="float")
    assert flat.data[0].embedding == vectors[2]


def test_a_batch_of_64_inputs_returns_in_order(served):
    """64 inputs (64 replica requests in two waves of 32, what the replica holds: 8 seats and 24
    waiting) come back in the inputs' order, each the vector of that input alone; the replica
    counts them in ``carpool:embedding_*``."""
    before = served.metrics()
    inputs = [f"Item number {i} of the list is a {['cat', 'dog', 'bird', 'fish'][i % 4]}." for i in range(64)]
    batch = served.client.embeddings.create(model=served.model, input=inputs, encoding_format="float")
    assert [d.index for d in batch.data] == list(range(64))
    for i in (0, 17, 63):
        [alone] = served.client.embeddings.create(model=served.model, input=inputs[i], encoding_format="float").data
        assert cosine(alone.embedding, batch.data[i].embedding) >= 0.99999
        assert cosine(alone.embedding, batch.data[i + 1 if i < 63 else 0].embedding) < 0.9999
    after = served.metrics()
    assert after["carpool:embedding_requests_total"] - before.get("carpool:embedding_requests_total", 0) == 67
    prompt_tokens = after["carpool:embedding_prompt_tokens_total"] - before.get("carpool:embedding_prompt_tokens_total", 0)
    assert prompt_tokens >= batch.usage.prompt_tokens > 64
    assert after["carpool:embedding_request_latency_seconds_count"] >= 67
    # generation is served on the same replicas as before
    completion = served.client.completions.create(model=served.model, prompt="The capital of France is", max_tokens=4,
                                                  temperature=0)
    assert completion.choices[0].text


@pytest.mark.parametrize(
    ("kwargs", "param", "match"),
    [
        (dict(input=[]), "input", "must not be empty"),
        (dict(input=[""]), "input", "empty string"),
        (dict(input=["fine", ""]), "input", "empty string"),
        (dict(input=[[1, 49152]]), "input", "outside the vocabulary"),
        (dict(input=[[7] * 257]), "input", "maximum context length is 256"),
        (dict(input=[[7] * 8, [7] * 300]), "input.1", "maximum context length is 256"),
        (dict(input="hi", dimensions=32), "dimensions", "matryoshka"),
        (dict(input="hi", encoding_format="int8"), "encoding_format", "float"),
        (dict(input=[1.5]), "input", "must be a string"),
        (dict(input=["x"] * 2049), "input", "at most 2048 inputs"),  # OpenAI's limit
        (dict(input="hi", extra_body={"priority": 3}), "priority", "scheduling policy"),  # fcfs: vLLM's rule
    ],
)
def test_bad_input_is_an_openai_400(served, kwargs, param, match):
    """Each bad body is a 400 in OpenAI's error shape, naming the field; nothing runs."""
    with pytest.raises(openai.BadRequestError) as caught:
        served.client.embeddings.create(model=served.model, **kwargs)
    error = caught.value.body
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["param"] == param and match in error["message"], error
