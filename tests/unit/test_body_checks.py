"""``logit_bias`` parsing (router/body_checks.py): keys are token ids as strings, values biases."""

from __future__ import annotations

import pytest

from router.body_checks import parse_logit_bias
from router.protocol import OpenAIError


def test_valid_bias_is_parsed():
    assert parse_logit_bias({"5": -100, "0007": 2.5, "0": 100}, vocab_size=10) == {5: -100.0, 7: 2.5, 0: 100.0}
    assert parse_logit_bias({"0" * 30 + "1": 1}, vocab_size=10) == {1: 1.0}  # leading zeros are still token 1
    assert parse_logit_bias({"0" * 5000 + "1": 1, "0" * 5000: 2}, vocab_size=10) == {1: 1.0, 0: 2.0}  # past int()'s 4,300 digits
    assert parse_logit_bias(None) is None and parse_logit_bias({}) is None


@pytest.mark.parametrize(
    "raw",
    [{"10": 1}, {"9" * 5000: 1}, {"-1": 1}, {"1.5": 1}, {"x": 1}, {" 5": 1}, {"５": 1}, {"5": 101}, {"5": "1"}, {"5": True},
     {"5": 10**309}, {"5": -(10**4000)}, {"5": float("nan")}],  # ints past a float's range too
)
def test_bad_bias_is_a_400_naming_logit_bias(raw):
    with pytest.raises(OpenAIError) as info:
        parse_logit_bias(raw, vocab_size=10)
    assert info.value.status_code == 400 and info.value.param == "logit_bias"
