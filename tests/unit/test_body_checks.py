"""``logit_bias`` parsing (router/request/body_checks.py): keys are token ids as strings, values
biases; ``priority`` (the body field and the ingress's check against the replicas' scheduling policy)."""

from __future__ import annotations

import pytest

from router.request.body_checks import parse_logit_bias
from router.request.protocol import OpenAIError


def test_valid_bias_is_parsed():
    assert parse_logit_bias({"5": -100, "0007": 2.5, "0": 100}) == {5: -100.0, 7: 2.5, 0: 100.0}
    assert parse_logit_bias({"0" * 30 + "1": 1}) == {1: 1.0}  # leading zeros are still token 1
    assert parse_logit_bias({"0" * 5000 + "1": 1, "0" * 5000: 2}) == {1: 1.0, 0: 2.0}  # past int()'s 4,300 digits
    assert parse_logit_bias(None) is None and parse_logit_bias({}) is None


@pytest.mark.parametrize(
    "raw",
    [{"9" * 5000: 1}, {"-1": 1}, {"1.5": 1}, {"x": 1}, {" 5": 1}, {"５": 1}, {"5": 101}, {"5": "1"}, {"5": True},
     {"5": 10**309}, {"5": -(10**4000)}, {"5": float("nan")}],  # ints past a float's range too
)
def test_bad_bias_is_a_400_naming_logit_bias(raw):
    with pytest.raises(OpenAIError) as info:
        parse_logit_bias(raw)
    assert info.value.status_code == 400 and info.value.param == "logit_bias"


# ---- priority (vLLM's extra: lower runs first) ---------------------------------------------------


@pytest.mark.parametrize("value", ["1", 1.5, True, None, [1], 2**63, -(2**63)])
def test_a_priority_that_is_not_an_int64_is_a_400_naming_priority(value):
    from pydantic import ValidationError

    from router.request.errors import validation_error
    from router.request.protocol import ChatCompletionRequest, CompletionRequest

    for model, body in ((CompletionRequest, {"prompt": "x"}), (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]})):
        with pytest.raises(ValidationError) as info:
            model(**body, priority=value)
        error = validation_error(info.value.errors())
        assert error.status_code == 400 and error.param == "priority", error.message
    assert CompletionRequest(prompt="x").priority == 0 and CompletionRequest(prompt="x", priority=-3).priority == -3


def test_priority_needs_the_priority_scheduling_policy(smollm2_tokenizer):
    """Under the replicas' fcfs policy (or a replica too old to say) a nonzero priority is a 400
    naming ``priority``, as vLLM refuses it; under ``priority`` every choice's envelope carries it."""
    import asyncio

    from router.config import IngressConfig
    from router.request.preparation import RequestPreparer
    from router.request.protocol import CompletionRequest

    preparer = RequestPreparer(IngressConfig(), smollm2_tokenizer, "m")
    info = {"max_model_len": 256, "vocab_size": 49152, "block_size": 16}
    for policy in ({}, {"scheduling_policy": "fcfs"}):
        with pytest.raises(OpenAIError) as error:
            asyncio.run(preparer.completion(CompletionRequest(prompt=[5, 6], priority=2), {**info, **policy}))
        assert error.value.status_code == 400 and error.value.param == "priority"
        assert "only applicable when the scheduling policy is 'priority'" in error.value.message
        assert asyncio.run(preparer.completion(CompletionRequest(prompt=[5, 6]), {**info, **policy})).priority == 0
    prepared = asyncio.run(preparer.completion(CompletionRequest(prompt=[[5, 6], [7]], n=2, priority=-4), {**info, "scheduling_policy": "priority"}))
    envelopes = [prepared.envelope(i, p, params) for i, p, _, params in prepared.jobs()]
    assert len(envelopes) == 4 and all(e.priority == -4 for e in envelopes)


@pytest.mark.parametrize("ids", [[-1], [4294967296], [2**70], [[1, 2], [-5]]])
def test_echoed_token_ids_are_checked_before_they_are_decoded(smollm2_tokenizer, ids):
    """``echo`` decodes a token-id prompt for the reply: an id the tokenizer cannot take (negative,
    past 32 bits) is the vocabulary's 400 naming the prompt, not the decoder's OverflowError (a 500)."""
    import asyncio

    from router.config import IngressConfig
    from router.request.preparation import RequestPreparer
    from router.request.protocol import CompletionRequest

    preparer = RequestPreparer(IngressConfig(), smollm2_tokenizer, "m")
    info = {"max_model_len": 256, "vocab_size": 49152, "block_size": 16}
    with pytest.raises(OpenAIError) as error:
        asyncio.run(preparer.completion(CompletionRequest(prompt=ids, echo=True, max_tokens=3), info))
    assert error.value.status_code == 400 and error.value.param.startswith("prompt")
    assert "outside the vocabulary" in error.value.message
