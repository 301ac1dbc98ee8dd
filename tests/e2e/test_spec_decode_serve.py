"""Speculative decoding served end to end (real Ray Serve, one replica, real SmolLM2 in the
served default dtype, prompt lookup, the real ``openai`` client): streamed output equals the
non-streamed one, usage counts only the tokens emitted, the replica's drafts and accepted tokens
reach ``/metrics``, and the replica ends idle with every block free (conftest).

That the tokens equal those without speculation is checked on the engine, in float32
(``tests/engine/test_spec_decode.py``).
"""

from __future__ import annotations

import pytest
from cluster.bench.workloads.input_grounded import input_grounded_prompts
from cluster.config import ServeConfig
from replica.config.engine_config import EngineConfig

ENGINE = EngineConfig(
    max_num_seqs=8, max_model_len=1024, num_blocks=160, compile=False,
    speculative_config={"method": "ngram", "num_speculative_tokens": 4},
)
CONFIG = ServeConfig(app_name="e2e-spec-decode", engine=ENGINE)


@pytest.fixture(scope="module")
def served(deploy):
    with deploy(CONFIG, replicas=1) as served:
        yield served


def test_streamed_equals_non_streamed_and_usage_counts_emitted_tokens(served):
    before = served.metrics()
    prompts = [p.prompt for p in input_grounded_prompts(3, seed=2)]
    for prompt in prompts:
        messages = [{"role": "user", "content": prompt}]
        whole = served.client.chat.completions.create(
            model=served.config.model_name, messages=messages, max_tokens=64, temperature=0
        )
        stream = served.client.chat.completions.create(
            model=served.config.model_name, messages=messages, max_tokens=64, temperature=0,
            stream=True, stream_options={"include_usage": True},
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content
        usage = chunks[-1].usage
        assert usage.completion_tokens == whole.usage.completion_tokens <= 64
        assert usage.prompt_tokens == whole.usage.prompt_tokens
        if whole.choices[0].finish_reason == "length":
            assert whole.usage.completion_tokens == 64  # not 64 + accepted drafts past it
    after = served.metrics()
    drafted = after["carpool:spec_decode_num_draft_tokens_total"] - before.get("carpool:spec_decode_num_draft_tokens_total", 0)
    accepted = after["carpool:spec_decode_num_accepted_tokens_total"] - before.get("carpool:spec_decode_num_accepted_tokens_total", 0)
    assert drafted > 0 and 0 < accepted <= drafted


def test_a_bad_request_still_gets_a_4xx_and_the_next_one_succeeds(served):
    import openai

    with pytest.raises(openai.BadRequestError):
        served.client.completions.create(model=served.config.model_name, prompt="hi", max_tokens=-1)
    out = served.client.completions.create(model=served.config.model_name, prompt="Repeat: a b c a b c a b", max_tokens=8, temperature=0)
    assert out.usage.completion_tokens <= 8
