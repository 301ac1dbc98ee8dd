"""Log-probabilities of given tokens under a step's logits: the sampled token's (``logprobs``) and
each prompt token's given the tokens before it (``prompt_logprobs``).

Both are vLLM's: the log-softmax of the model's *raw* logits (before penalties, logit bias,
temperature or truncation), the token's rank among all tokens (1 = most likely) and the ``k``
most likely ``(token_id, logprob)`` pairs, best first.
"""

from __future__ import annotations

import torch

from replica.request import TokenLogprobs

# Rows per log-softmax: a long prompt's rows in float32 ([rows, V] × 4 bytes, 200 MB for 1,000
# rows of a 50k vocabulary) are worked through in slices of this many.
ROWS_PER_SLICE = 256


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, ks: list[int]) -> list[TokenLogprobs]:
    """The logprob, rank and top-``k`` alternatives of ``token_ids[i]`` under row ``i``.

    Args:
        logits: ``[n, V]`` raw logits, any float dtype (computed in float32); not modified.
        token_ids: ``[n]`` long, on ``logits``' device: the token each row scores.
        ks: ``n`` counts of top alternatives (0 to ``SamplingParams.MAX_LOGPROBS``).
    Returns:
        ``n`` :class:`TokenLogprobs`, in row order.
    """
    n = logits.shape[0]
    assert token_ids.shape == (n,) and len(ks) == n, f"{n} rows, {tuple(token_ids.shape)} tokens, {len(ks)} ks"
    ids = token_ids.tolist()
    out: list[TokenLogprobs] = []
    for lo in range(0, n, ROWS_PER_SLICE):
        hi = min(n, lo + ROWS_PER_SLICE)
        logprobs = logits[lo:hi].float().log_softmax(dim=-1)  # [m, V]
        chosen = logprobs.gather(1, token_ids[lo:hi].unsqueeze(1))  # [m, 1]
        ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
        chosen_list = chosen.squeeze(1).tolist()
        max_k = max(ks[lo:hi])
        if max_k > 0:
            top = logprobs.topk(max_k, dim=-1)
            top_values, top_ids = top.values.tolist(), top.indices.tolist()
        for j in range(hi - lo):
            k = ks[lo + j]
            pairs = list(zip(top_ids[j][:k], top_values[j][:k])) if k > 0 else []
            out.append(TokenLogprobs(token_id=ids[lo + j], logprob=chosen_list[j], rank=ranks[j], top=pairs))
    return out
