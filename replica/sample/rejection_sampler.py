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
(penalties and ``min_tokens`` see them, a structured-output constraint has consumed them and gives
them back at the end), from the rows' :class:`~replica.sample.metadata.SamplingMetadata`, by the
same :class:`~replica.sample.sampler.Sampler` as any other step; a greedy row's tokens are the
argmax of each position. Verification stops at a token that may end the request (EOS, a stop
token, a completed constraint): the scheduler's stop checks decide from there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from replica.protocol.outputs import TokenLogprobs
from replica.sample.metadata import SamplingMetadata
from replica.sample.sampler import Sampler, greedy_argmax


def accept_draft(sampled: int, draft: int) -> bool:
    """The acceptance rule for a deterministic draft: keep it iff the target's own draw equals it."""
    return sampled == draft


def verify(
    sampler: Sampler, logits: Sequence[torch.Tensor], metadata: SamplingMetadata, drafts: Sequence[Sequence[int]]
) -> list[tuple[list[int], list[TokenLogprobs | None]]]:
    """Verify each row's drafts.

    Args:
        sampler: the step's sampler.
        logits: per row ``[k_i + 1, V]``: row ``j < k_i`` scores draft ``j``, row ``k_i`` the
            token after the last draft.
        metadata: one row per request, its state before this step's tokens (its output tokens are
            not changed; its constraint is left as found, but for a dead end met at position 0).
        drafts: per row its ``k_i`` drafted token ids.
    Returns:
        Per row ``(tokens, logprobs)``: its accepted drafts then one more token (``1`` to
        ``k_i + 1`` tokens), and each token's logprobs entry (None unless asked for).
    """
    if metadata.plain_greedy().all():
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
    return _verify_in_order(sampler, logits, metadata, drafts)


def _verify_in_order(
    sampler: Sampler, logits: Sequence[torch.Tensor], metadata: SamplingMetadata, drafts: Sequence[Sequence[int]]
) -> list[tuple[list[int], list[TokenLogprobs | None]]]:
    """Position by position, each a batched :class:`Sampler` call over the rows still accepting,
    with the accepted tokens appended to copies of their output tokens (and consumed by their
    constraints) until the end, when the constraints are rolled back."""
    num_rows = metadata.num_rows
    tokens: list[list[int]] = [[] for _ in range(num_rows)]
    logprobs: list[list[TokenLogprobs | None]] = [[] for _ in range(num_rows)]
    outputs = [list(o) for o in metadata.output_token_ids]  # with the accepted drafts so far
    grammars = metadata.grammars
    appended = [0] * num_rows  # accepted tokens on outputs, and on the constraint
    dead_ends = [g.dead_end if g is not None else False for g in grammars]  # restored after
    active = list(range(num_rows))
    try:
        for j in range(max(len(d) for d in drafts) + 1):
            if not active:
                break
            rows = metadata.select(active).with_outputs([outputs[i] for i in active])
            out = sampler(torch.stack([logits[i][j] for i in active]), rows)
            still = []
            for i, token, lp in zip(active, out.token_ids, out.logprobs):
                draft, grammar = drafts[i], grammars[i]
                if grammar is not None and grammar.dead_end:  # no token allowed here
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
                if not accepted or draft[j] in metadata.end_ids[i]:  # a token that may end the request
                    continue
                if grammar is not None and not (grammar.accept(draft[j]) and not grammar.is_finished):
                    grammar.rollback(1, dead_ends[i])  # the constraint ends here: the scheduler decides
                    continue
                outputs[i].append(draft[j])
                appended[i] += 1
                still.append(i)
            active = still
    finally:
        for grammar, n, dead_end in zip(grammars, appended, dead_ends):
            if grammar is not None:
                grammar.rollback(n, dead_end)
    return list(zip(tokens, logprobs))
