"""Verifying drafts (speculative decoding): which of a row's drafted tokens the target model keeps,
and the token after them.

Speculative sampling (Leviathan, Kalman and Matias 2023, "Fast Inference from Transformers via
Speculative Decoding", ICML; Chen et al. 2023, "Accelerating Large Language Model Decoding with
Speculative Sampling", arXiv:2302.01318) accepts draft ``d`` drawn from ``q`` with probability
``min(1, p(d) / q(d))`` and, on a rejection, draws from ``norm(max(0, p - q))``; the output then
follows the target ``p`` exactly. Carpool's proposers are deterministic (prompt lookup; a draft
model's argmax), so ``q`` is one-hot on ``d``: acceptance is ``p(d)`` and the residual is ``p``
without ``d``, renormalized. Both come from one draw: sample ``x ~ p`` exactly as the step would
without speculation, and accept ``d`` iff ``x == d``; on a rejection ``x`` (≠ ``d``, so drawn from
the residual) is the row's last token. So a request consumes its random numbers (its seeded
``torch.Generator``) once per emitted token, as without speculation, and a seed gives the same
tokens with speculation on or off.

Position ``j`` of a row is sampled with the request's state after its first ``j`` accepted tokens
(penalties and ``min_tokens`` see them, a structured-output constraint has consumed them), by the
same :class:`~replica.sample.sampler.Sampler` as any other step; a greedy row's tokens are the
argmax of each position. Verification stops at a token that may end the request (EOS, a stop
token, a completed constraint): the scheduler's stop checks decide from there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from replica.core.request import Request
from replica.protocol.outputs import TokenLogprobs
from replica.sample.sampler import Sampler, greedy_argmax, is_plain_greedy


def accept_draft(sampled: int, draft: int) -> bool:
    """The acceptance rule for a deterministic draft: keep it iff the target's own draw equals it."""
    return sampled == draft


def verify(
    sampler: Sampler, logits: Sequence[torch.Tensor], requests: Sequence[Request], drafts: Sequence[Sequence[int]]
) -> list[tuple[list[int], list[TokenLogprobs | None]]]:
    """Verify each request's drafts.

    Args:
        sampler: the step's sampler.
        logits: per request ``[k_i + 1, V]``: row ``j < k_i`` scores draft ``j``, row ``k_i`` the
            token after the last draft.
        requests: the rows' requests (state before this step's tokens; left as found).
        drafts: per request its ``k_i`` drafted token ids.
    Returns:
        Per request ``(tokens, logprobs)``: its accepted drafts then one more token (``1`` to
        ``k_i + 1`` tokens), and each token's logprobs entry (None unless asked for).
    """
    if all(is_plain_greedy(r) for r in requests):
        flat = greedy_argmax(torch.cat(list(logits))).tolist()
        results, offset = [], 0
        for block, draft in zip(logits, drafts):
            best = flat[offset : offset + block.shape[0]]
            offset += block.shape[0]
            n = 0
            while n < len(draft) and accept_draft(best[n], draft[n]):
                n += 1
            results.append((list(draft[:n]) + [best[n]], [None] * (n + 1)))
        return results
    return _verify_in_order(sampler, logits, requests, drafts)


def _ends_request(request: Request, token: int) -> bool:
    params = request.sampling_params
    return (not params.ignore_eos and token in request.eos_token_ids) or token in params.stop_token_ids


def _verify_in_order(sampler, logits, requests, drafts) -> list[tuple[list[int], list[TokenLogprobs | None]]]:
    """Position by position, each a batched :class:`Sampler` call over the rows still accepting,
    with the accepted tokens appended to their requests (and consumed by their constraints) until
    the end, when both are undone."""
    tokens: list[list[int]] = [[] for _ in requests]
    logprobs: list[list[TokenLogprobs | None]] = [[] for _ in requests]
    appended = [0] * len(requests)  # accepted tokens on output_token_ids, and on the constraint
    dead_ends = [r.grammar.dead_end if r.grammar is not None else False for r in requests]  # restored after
    active = list(range(len(requests)))
    try:
        for j in range(max(len(d) for d in drafts) + 1):
            if not active:
                break
            out = sampler(torch.stack([logits[i][j] for i in active]), [requests[i] for i in active])
            still = []
            for i, token, lp in zip(active, out.token_ids, out.logprobs):
                request, draft = requests[i], drafts[i]
                if request.grammar is not None and request.grammar.dead_end:  # no token allowed here
                    if j == 0:  # the scheduler ends the request on this token, as without drafts
                        dead_ends[i] = True
                        tokens[i].append(token)
                        logprobs[i].append(lp)
                    # Past position 0 the row emits the drafts accepted so far; the next step
                    # meets the dead end again, after the scheduler has taken them.
                    continue
                accepted = j < len(draft) and accept_draft(token, draft[j])
                tokens[i].append(draft[j] if accepted else token)
                logprobs[i].append(lp)
                if not accepted or _ends_request(request, draft[j]):
                    continue
                grammar = request.grammar
                if grammar is not None and not (grammar.accept(draft[j]) and not grammar.is_finished):
                    grammar.rollback(1, dead_ends[i])  # the constraint ends here: the scheduler decides
                    continue
                request.output_token_ids.append(draft[j])
                appended[i] += 1
                still.append(i)
            active = still
    finally:
        for request, n, dead_end in zip(requests, appended, dead_ends):
            if n:
                del request.output_token_ids[-n:]
            if request.grammar is not None:
                request.grammar.rollback(n, dead_end)
    return list(zip(tokens, logprobs))
