"""LoRA adapters served end to end, through the real ``openai`` client: adapters given at start and
loaded at run time, their tokens (streamed and not, chat and completions, ``n`` > 1), ``/v1/models``,
unloading, every bad input with its status, the adapters' metrics.

One replica of SmolLM2 in float32 with LoRA on (2 device slots, ``max_lora_rank`` 16) and an API
key. The adapters are random rank-8 PEFT adapters made with ``peft`` for SmolLM2
(``tests/lora_adapters.make_adapter``: strong enough that greedy tokens change), all in one
``--lora-dir``: ``sql`` and ``chat`` are ``lora_modules``; ``poem`` (a copy of ``chat``'s files) is
loaded at run time. The bad ones: rank 32, an adapter made for a smaller Llama (shapes that do not
fit), one made for GPT-NeoX (modules SmolLM2 lacks), an empty folder. After every test the replica
is idle with every KV block free (conftest).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time

import httpx
import openai
import pytest

from cluster.app import check_lora_modules
from cluster.config import ServeConfig
from replica.config.engine_config import EngineConfig
from tests.e2e.test_input import assert_openai_error

KEY = "lora-key-3f"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name a color."}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(smollm2_path, tmp_path_factory) -> dict[str, str]:
    """Folders of the test's adapters: ``sql``, ``chat`` (good, in the lora dir ``root``), ``rank32``,
    ``small_llama``, ``neox`` and ``empty`` (bad, in ``root`` too), ``outside`` (good, outside it)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM

    from tests.lora_adapters import make_adapter

    root = tmp_path_factory.mktemp("loras")
    other = tmp_path_factory.mktemp("elsewhere")
    found = {"root": str(root)}
    found["sql"] = make_adapter(smollm2_path, root / "sql", r=8, target_modules=("q_proj", "v_proj"), seed=1)
    found["chat"] = make_adapter(smollm2_path, root / "chat", r=8, seed=2)
    found["rank32"] = make_adapter(smollm2_path, root / "rank32", r=32, target_modules=("q_proj",), seed=3)
    found["outside"] = str(shutil.copytree(found["sql"], other / "sql-copy"))
    small = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=256)
    LlamaForCausalLM(small).save_pretrained(other / "small-llama")
    found["small_llama"] = make_adapter(str(other / "small-llama"), root / "small-llama", target_modules=("q_proj", "v_proj"))
    neox = GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=256)
    GPTNeoXForCausalLM(neox).save_pretrained(other / "neox")
    found["neox"] = make_adapter(str(other / "neox"), root / "neox", target_modules=("query_key_value",))
    (root / "empty").mkdir()
    found["empty"] = str(root / "empty")
    return found


@pytest.fixture(scope="module")
def served(deploy, adapters, smollm2_path):
    config = ServeConfig(
        app_name="e2e-lora",
        engine=EngineConfig(model=smollm2_path, dtype="float32", max_num_seqs=4, max_model_len=256, num_blocks=128,
                            compile=False, enable_lora=True, max_loras=2, max_lora_rank=16),
        served_model_name="smollm2",
        api_key=KEY,
        lora_modules={"sql": adapters["sql"], "chat": adapters["chat"]},
        lora_dirs=[adapters["root"]],
    )
    with deploy(config, replicas=1) as served:
        served.client = openai.OpenAI(base_url=served.base_url, api_key=KEY, max_retries=0, timeout=120)
        check_lora_modules(config)  # what `carpool serve` runs once the app is up
        yield served


def post(served, path: str, body, headers=AUTH) -> httpx.Response:
    """POST ``body`` (JSON; a string goes as is, as JSON) to ``/v1`` + ``path``."""
    if isinstance(body, str):
        return httpx.post(served.base_url + path, content=body, headers={**headers, "Content-Type": "application/json"}, timeout=60)
    return httpx.post(served.base_url + path, json=body, headers=headers, timeout=60)


def complete(served, model: str, stream: bool = False, prompt: str = PROMPT) -> str:
    if not stream:
        reply = served.client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert reply.model == model and reply.usage.completion_tokens > 0
        return reply.choices[0].text
    chunks = list(served.client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True))
    assert all(c.model == model for c in chunks)
    return "".join(c.choices[0].text for c in chunks if c.choices)


def chat(served, model: str, stream: bool = False, n: int = 1) -> list[str]:
    if not stream:
        reply = served.client.chat.completions.create(model=model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, n=n)
        assert reply.model == model
        return [c.message.content for c in sorted(reply.choices, key=lambda c: c.index)]
    texts = [""] * n
    for chunk in served.client.chat.completions.create(model=model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, n=n, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    return texts


def lora_stats(served) -> dict:
    """The one replica's ``LLMReplica.lora_stats()`` (through a handle: Serve's replica actors
    expose only Serve's own methods)."""
    from ray import serve

    return serve.get_deployment_handle("LLMReplica", app_name=served.name).lora_stats.remote().result(timeout_s=30)


def test_models_lists_each_adapter_with_its_parent(served, adapters):
    cards = {m.id: m for m in served.client.models.list().data}
    assert list(cards)[0] == "smollm2" and {"sql", "chat"} <= set(cards)
    for name in ("sql", "chat"):
        card = cards[name].model_dump()
        assert (card["parent"], card["root"], card["object"]) == ("smollm2", adapters[name], "model")
        assert served.client.models.retrieve(name).model_dump() == card
    assert getattr(cards["smollm2"], "parent", None) is None


def test_adapters_change_the_tokens_and_stream_the_same_as_not(served):
    base = complete(served, "smollm2")
    texts = {name: complete(served, name) for name in ("sql", "chat")}
    assert texts["sql"] != base and texts["chat"] != base and texts["sql"] != texts["chat"], (base, texts)
    for name, text in texts.items():
        assert complete(served, name, stream=True) == text, name
    assert complete(served, "smollm2", stream=True) == base
    # chat, n = 2 at temperature 0: both choices equal, streamed or not
    chats = {name: chat(served, name, n=2) for name in ("smollm2", "sql", "chat")}
    for name, choices in chats.items():
        assert choices[0] == choices[1], (name, choices)
        assert chat(served, name, stream=True, n=2) == choices, name
    assert chats["sql"][0] != chats["smollm2"][0] or chats["chat"][0] != chats["smollm2"][0], chats
    stats = lora_stats(served)
    assert {"sql", "chat"} <= set(stats["cached"]) and stats["num_slot_loads"] >= 2


def test_load_at_run_time_then_use_then_unload(served, adapters):
    poem = str(shutil.copytree(adapters["chat"], os.path.join(adapters["root"], "poem")))
    r = post(served, "/load_lora_adapter", {"lora_name": "poem", "lora_path": poem})
    assert r.status_code == 200, r.text
    card = r.json()
    assert (card["id"], card["parent"], card["root"], card["rank"]) == ("poem", "smollm2", os.path.realpath(poem), 8)
    assert "poem" in [m.id for m in served.client.models.list().data]
    assert complete(served, "poem") == complete(served, "chat")  # the same files under another name
    assert complete(served, "poem", stream=True) == complete(served, "chat")
    assert "poem" in lora_stats(served)["cached"]

    r = post(served, "/unload_lora_adapter", {"lora_name": "poem"})
    assert r.status_code == 200 and r.json()["deleted"], r.text
    complete(served, "smollm2")  # lora_stats is the engine's snapshot after its latest change
    assert "poem" not in lora_stats(served)["cached"]  # the replica forgot it too
    assert "poem" not in [m.id for m in served.client.models.list().data]
    with pytest.raises(openai.NotFoundError) as caught:
        complete(served, "poem")
    assert caught.value.body["code"] == "model_not_found"
    assert_openai_error(post(served, "/unload_lora_adapter", {"lora_name": "poem"}), 404, "lora_name", "model_not_found")
    # loaded again under the same name: served again
    assert post(served, "/load_lora_adapter", {"lora_name": "poem", "lora_path": poem}).status_code == 200
    assert complete(served, "poem") == complete(served, "chat")
    assert post(served, "/unload_lora_adapter", {"lora_name": "poem"}).status_code == 200


def test_every_bad_input_has_its_status(served, adapters):
    root = adapters["root"]
    for create in (lambda: complete(served, "nope"), lambda: chat(served, "nope", stream=True),
                   lambda: served.client.models.retrieve("nope")):
        with pytest.raises(openai.NotFoundError) as caught:
            create()
        assert caught.value.body["code"] == "model_not_found" and "nope" in caught.value.body["message"]

    def load(name: str, path: str) -> httpx.Response:
        return post(served, "/load_lora_adapter", {"lora_name": name, "lora_path": path})

    # outside --lora-dir: plainly, through "..", through a symlink inside it
    link = os.path.join(root, "link-out")
    os.symlink(adapters["outside"], link)
    for path in (adapters["outside"], os.path.join(root, "..", os.path.basename(os.path.dirname(adapters["outside"])), "sql-copy"), link):
        assert_openai_error(load("x", path), 400, "lora_path", "invalid_value")
    # what the replica refuses, each named
    for path, reason in [(adapters["rank32"], "exceeds max_lora_rank=16"), (adapters["small_llama"], "the base layer needs"),
                         (adapters["neox"], "is not a linear layer of the base model"), (adapters["empty"], "no adapter_config.json"),
                         (os.path.join(root, "missing"), "is not a folder")]:
        error = assert_openai_error(load("x", path), 400, code="invalid_lora_adapter")
        assert reason in error["message"] and error["param"] == "lora_path", error
    assert_openai_error(load("sql", adapters["chat"]), 400, "lora_name", "invalid_value")  # taken
    assert_openai_error(load("smollm2", adapters["chat"]), 400, "lora_name", "invalid_value")  # the base model's
    assert_openai_error(post(served, "/unload_lora_adapter", {"lora_name": "smollm2"}), 400, "lora_name")
    # no key, malformed bodies
    assert_openai_error(post(served, "/load_lora_adapter", {"lora_name": "x", "lora_path": root}, headers={}), 401, code="invalid_api_key")
    assert_openai_error(post(served, "/unload_lora_adapter", {"lora_name": "sql"}, headers={}), 401, code="invalid_api_key")
    assert_openai_error(post(served, "/load_lora_adapter", {"lora_name": "x"}), 400, "lora_path")
    assert_openai_error(post(served, "/load_lora_adapter", {"lora_name": 7, "lora_path": root}), 400, "lora_name")
    assert_openai_error(post(served, "/load_lora_adapter", "{"), 400, code="invalid_json")
    assert_openai_error(post(served, "/unload_lora_adapter", []), 400)
    assert {"sql", "chat"} <= {m.id for m in served.client.models.list().data}
    assert "x" not in lora_stats(served)["cached"]


def test_a_bad_load_does_not_disturb_other_adapters_requests(served, adapters):
    solo = {name: complete(served, name, stream=True) for name in ("sql", "chat", "smollm2")}

    async def scenario():
        async with openai.AsyncOpenAI(base_url=served.base_url, api_key=KEY, max_retries=0, timeout=120) as client, \
                httpx.AsyncClient(base_url=served.base_url, headers=AUTH, timeout=60) as http:

            async def one(name: str) -> str:
                stream = await client.completions.create(model=name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True)
                return "".join([c.choices[0].text async for c in stream if c.choices])

            async def bad_loads() -> list[int]:
                codes = []
                for path in (adapters["rank32"], adapters["small_llama"], adapters["neox"]):
                    r = await http.post("/load_lora_adapter", json={"lora_name": "bad", "lora_path": path})
                    codes.append(r.status_code)
                return codes

            names = ["sql", "chat", "smollm2", "sql", "chat"]
            *texts, codes = await asyncio.gather(*(one(n) for n in names), bad_loads())
            return names, texts, codes

    names, texts, codes = asyncio.run(scenario())
    assert codes == [400, 400, 400]
    for name, text in zip(names, texts):
        assert text == solo[name], (name, text, solo[name])


def test_adapter_metrics_one_series_per_adapter(served, adapters):
    complete(served, "sql")
    poem = str(shutil.copytree(adapters["sql"], os.path.join(adapters["root"], "metered")))
    assert post(served, "/load_lora_adapter", {"lora_name": "metered", "lora_path": poem}).status_code == 200
    complete(served, "metered")

    def scrape() -> str:
        r = httpx.get(served.root_url + "/metrics", headers=AUTH, timeout=30)
        assert r.status_code == 200
        return r.text

    text = scrape()
    for name in ("sql", "metered"):
        assert f'carpool:lora_requests_running{{adapter="{name}",model_name="smollm2"' in text, text
        assert f'carpool:lora_requests_waiting{{adapter="{name}",model_name="smollm2"' in text
    assert 'carpool:lora_adapters_loaded{model_name="smollm2"' in text
    loads = [line for line in text.splitlines() if line.startswith("carpool:lora_adapter_loads_total{")]
    assert len(loads) == 1 and float(loads[0].rsplit(" ", 1)[1]) >= 1, loads
    assert post(served, "/unload_lora_adapter", {"lora_name": "metered"}).status_code == 200
    deadline = time.monotonic() + 30
    while 'adapter="metered"' in scrape():  # gone once the replica's snapshot has it forgotten
        assert time.monotonic() < deadline, "the unloaded adapter's series stayed"
        complete(served, "smollm2")
        time.sleep(0.2)


def test_a_bad_lora_module_is_refused_at_start_by_name(served, adapters):
    config = ServeConfig(app_name=served.name, lora_modules={"sql": adapters["sql"], "big": adapters["rank32"]})
    with pytest.raises(ValueError, match=r"lora_modules: big=.*rank32: .*exceeds max_lora_rank=16"):
        check_lora_modules(config)
