"""Prompt lookup (n-gram) drafts: copy what followed the latest earlier occurrence of the request's
last tokens.

Prompt lookup decoding (Saxena 2023, github.com/apoorvumang/prompt-lookup-decoding; vLLM's
``method: ngram``): for ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``, find the
last ``n`` tokens of prompt + output earlier in the same sequence; the up to ``k`` tokens that
followed that occurrence are the drafts. Carpool takes the latest occurrence (the nearest context).
Costs no forward: a few vectorized comparisons over the sequence.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from replica.core.request import Request
from replica.core.scheduler_output import ScheduledRequest


def lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Drafts for the sequence ``tokens`` ``[L]`` (int64): the up to ``k`` tokens after the latest
    earlier occurrence of its last ``n`` tokens, for the largest ``n`` in ``[min_n, max_n]`` that
    occurs; empty if none does."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows starting at 0 .. length - n - 1: every earlier occurrence followed by a token.
        windows = sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer:
    """Prompt lookup over each request's prompt + output (:func:`lookup`).

    Args:
        prompt_lookup_min, prompt_lookup_max: the suffix lengths tried, longest first.
    """

    seconds_per_position = 0.0

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self._found: dict[str, list[int]] = {}  # request id -> drafts found by available()

    def available(self, request: Request, max_drafts: int) -> int:
        tokens = np.asarray(request.all_token_ids, dtype=np.int64)
        drafts = lookup(tokens, self.min_n, self.max_n, max_drafts)
        self._found[request.request_id] = drafts
        return len(drafts)

    def propose(self, rows: list[ScheduledRequest], counts: list[int]) -> list[list[int]]:
        drafts = [self._found.get(row.request.request_id, [])[:count] for row, count in zip(rows, counts)]
        self._found.clear()  # found for this step only
        return drafts

    def forget(self, request_id: str) -> None:
        self._found.pop(request_id, None)
