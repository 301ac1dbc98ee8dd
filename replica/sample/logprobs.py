"""Log-probabilities of given tokens under a step's logits: the sampled token's (``logprobs``) and
each prompt token's given the tokens before it (``prompt_logprobs``).

Both are vLLM's: the log-softmax of the model's *raw* logits (before penalties, logit bias,
temperature or truncation), the token's rank among all tokens (1 = most likely) and the ``k``
most likely ``(token_id, logprob)`` pairs, best first.
"""

from __future__ import annotations

import torch

from replica.protocol.outputs import TokenLogprobs
from replica.protocol.sampling_params import SamplingParams

# Rows per log-softmax: a long prompt's rows in float32 ([rows, V] × 4 bytes, 200 MB for 1,000
# rows of a 50k vocabulary) are worked through in slices of this many.
ROWS_PER_SLICE = 256

# Every row's alternatives come from one ``topk`` of this many, whatever its ``k``: torch orders
# tied values differently for different ``k`` (topk(1) and topk(20)[:1] can name different tokens
# of equal logprob), so a ``k`` taken from the step's largest request made a row's list depend on
# its batch mates. On CPU that settles it (torch picks its algorithm from k and the vocabulary);
# CUDA's topk also looks at the number of rows, so there tied alternatives may still come out in
# another order in another batch.
TOP_K = SamplingParams.MAX_LOGPROBS


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
        if max(ks[lo:hi]) > 0:
            top = logprobs.topk(min(TOP_K, logprobs.shape[-1]), dim=-1)
            top_values, top_ids = top.values.tolist(), top.indices.tolist()
        for j in range(hi - lo):
            k = ks[lo + j]
            pairs = list(zip(top_ids[j][:k], top_values[j][:k])) if k > 0 else []
            out.append(TokenLogprobs(token_id=ids[lo + j], logprob=chosen_list[j], rank=ranks[j], top=pairs))
    return out
