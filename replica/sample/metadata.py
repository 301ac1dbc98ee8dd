"""The sampler's inputs for one step: :class:`SamplingMetadata`, one entry per logits row.

vLLM v1's design: the worker's persistent batch (:mod:`replica.worker.sampling_batch`) keeps every
seated request's sampling inputs per seat, written once when the request takes its seat and
cleared when it leaves, and gathers a step's rows from them (a few NumPy gathers). The sampler,
its logits processors and the rejection sampler read only this object, never the scheduler's
request state (``tests/unit/test_layers.py`` keeps ``replica.sample`` free of ``replica.core``).

Numbers are host NumPy arrays ``[N]`` (``N`` = rows); the sampler copies to the logits' device only
the ones a step uses. Objects are per-row lists. The output tokens are the request's own list (by
reference, not a copy): they hold every token known when the row is sampled, also under async
scheduling, where the token of the step before is appended after this step's inputs were built.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, Sequence

import numpy as np
import torch

# Temperatures below this sample greedily (as vLLM's _SAMPLING_EPS): dividing by ~0 overflows.
GREEDY_TEMPERATURE_EPS = 1e-5

__all__ = ["GREEDY_TEMPERATURE_EPS", "LogitBias", "SamplingMetadata"]


@dataclass(frozen=True)
class LogitBias:
    """One request's OpenAI ``logit_bias`` as arrays: ``token_ids`` ``[k]`` int64 (distinct, each
    ``< V``) and ``biases`` ``[k]`` float32, in the dict's order."""

    token_ids: np.ndarray
    biases: np.ndarray

    @classmethod
    def of(cls, bias: dict[int, float]) -> "LogitBias":
        return cls(np.fromiter(bias.keys(), dtype=np.int64, count=len(bias)),
                   np.fromiter(bias.values(), dtype=np.float32, count=len(bias)))


@dataclass
class SamplingMetadata:
    """Per-row sampling inputs of one step (``N`` rows, row ``i`` = logits row ``i``).

    Numbers (NumPy ``[N]``): ``temperature`` (float32), ``greedy`` (bool: the request's temperature,
    as a Python float, is below :data:`GREEDY_TEMPERATURE_EPS`), ``top_k`` (int64; ``<= 0`` or
    ``>= V`` = off), ``top_p`` (float32; 1 = off), ``min_p`` (float32; 0 = off),
    ``repetition_penalty`` / ``frequency_penalty`` / ``presence_penalty`` (float32),
    ``penalized`` (bool: any of the three set), ``min_tokens`` (int64), ``num_logprobs`` (int64;
    -1 = no logprobs), ``has_bias`` and ``constrained`` (bool), ``plain`` (bool: greedy with no logit
    bias, penalty, constraint or logprobs; the request's part of :meth:`plain_greedy`).

    Objects (lists of ``N``): ``logit_bias`` (:class:`LogitBias` or None), ``end_ids`` (the token
    ids that may end the request: its EOS ids unless ``ignore_eos``, and its ``stop_token_ids``;
    what ``min_tokens`` bans), ``generators`` (the seeded request's ``torch.Generator``, else None;
    drawing advances it), ``grammars`` (:class:`~replica.sample.grammar.Grammar` or None; masks
    advance nothing, but a dead end is marked on it), ``prompt_token_ids`` (int64 array, set for
    penalized rows only, else None) and ``output_token_ids`` (the tokens generated before this
    sample; read, never changed by the sampler).
    """

    temperature: np.ndarray
    greedy: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    repetition_penalty: np.ndarray
    frequency_penalty: np.ndarray
    presence_penalty: np.ndarray
    penalized: np.ndarray
    min_tokens: np.ndarray
    num_logprobs: np.ndarray
    has_bias: np.ndarray
    constrained: np.ndarray
    plain: np.ndarray
    logit_bias: list[LogitBias | None]
    end_ids: list[frozenset[int]]
    generators: list[torch.Generator | None]
    grammars: list[Any]
    prompt_token_ids: list[np.ndarray | None]
    output_token_ids: list[Sequence[int]]

    @property
    def num_rows(self) -> int:
        return len(self.temperature)

    @cached_property
    def all_plain_greedy(self) -> bool:
        """Every row is plain greedy (:meth:`plain_greedy`) whatever its output length: the
        sampler's fast path. Computed once per object (the persistent batch hands the same
        object to steps with the same seats)."""
        return bool(self.plain.all()) and not self.min_tokens.any()

    @cached_property
    def any_logprobs(self) -> bool:
        """Some row asks for logprobs."""
        return bool((self.num_logprobs >= 0).any())

    def select(self, rows: Sequence[int] | np.ndarray) -> "SamplingMetadata":
        """The metadata of ``rows`` (indices into this one's rows, in the order given)."""
        index = np.asarray(rows, dtype=np.int64)
        picked = index.tolist()
        arrays = {name: getattr(self, name)[index] for name in _ARRAYS}
        lists = {name: [getattr(self, name)[i] for i in picked] for name in _LISTS}
        return SamplingMetadata(**arrays, **lists)

    def with_outputs(self, output_token_ids: list[Sequence[int]]) -> "SamplingMetadata":
        """The same rows with other output tokens (the rejection sampler's accepted drafts)."""
        return replace(self, output_token_ids=output_token_ids)

    def below_min_tokens(self) -> np.ndarray:
        """``[N]`` bool: rows with fewer output tokens than their ``min_tokens`` (``min_tokens``
        bans their end ids this step)."""
        below = np.zeros(self.num_rows, dtype=bool)
        if self.min_tokens.any():
            for i in np.flatnonzero(self.min_tokens).tolist():
                below[i] = len(self.output_token_ids[i]) < self.min_tokens[i]
        return below

    def plain_greedy(self, below_min_tokens: np.ndarray | None = None) -> np.ndarray:
        """``[N]`` bool: greedy rows with nothing that needs float32 logits (no logit bias, no
        penalty, no ``min_tokens`` mask this step, no constraint, no logprobs)."""
        if below_min_tokens is None and not self.min_tokens.any():
            return self.plain
        below = self.below_min_tokens() if below_min_tokens is None else below_min_tokens
        return self.plain & ~below

    def min_tokens_banned(self, row: int, vocab_size: int, below_min_tokens: bool | None = None) -> list[int]:
        """The token ids ``min_tokens`` sets to ``-inf`` in ``row`` this step (ids below
        ``vocab_size``): its end ids while it has fewer than ``min_tokens`` output tokens; else none."""
        below = len(self.output_token_ids[row]) < self.min_tokens[row] if below_min_tokens is None else below_min_tokens
        return [t for t in self.end_ids[row] if t < vocab_size] if below else []


_ARRAYS = (
    "temperature", "greedy", "top_k", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
    "presence_penalty", "penalized", "min_tokens", "num_logprobs", "has_bias", "constrained", "plain",
)
_LISTS = ("logit_bias", "end_ids", "generators", "grammars", "prompt_token_ids", "output_token_ids")
