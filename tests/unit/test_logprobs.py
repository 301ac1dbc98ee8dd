"""``replica.sample.logprobs.token_logprobs``: a row's top alternatives do not depend on what the other
rows of its step ask for."""

from __future__ import annotations

import torch

from replica.sample.logprobs import token_logprobs


def test_tied_alternatives_are_the_same_alone_and_beside_a_larger_k():
    """torch's ``topk`` orders tied values differently for different ``k``: with three tokens tied
    for the best logit, ``topk(1)`` and ``topk(20)[:1]`` name different ones. A row asking for 1
    alternative must get the same one alone and beside a row asking for 20."""
    torch.manual_seed(0)
    logits = torch.randn(2, 49152)
    logits[0, [123, 36885, 40000]] = 10.0
    tokens = torch.tensor([123, 7])
    alone = [token_logprobs(logits[:1], tokens[:1], [k])[0].top for k in range(1, 21)]
    for k in range(1, 21):
        batched = token_logprobs(logits, tokens, [k, 20])[0].top
        assert batched == alone[k - 1], k
        assert len(batched) == k
    assert {t for t, _ in alone[2][:3]} == {123, 36885, 40000}
    assert alone[0][0][1] == alone[2][2][1]  # equal logprobs: a tie, broken the same way every time
