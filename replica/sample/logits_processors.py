"""Logits processors: the steps of the sampling pipeline (``replica/sample/sampler.py``) that change a
batch's logits before a token is drawn, vectorized over the rows that ask for them. Each reads its
rows' settings from the step's :class:`~replica.sample.metadata.SamplingMetadata`.

* :func:`apply_logit_bias`: OpenAI's ``logit_bias`` ``{token id: bias}``, one ``index_put_`` over
  all (row, token) pairs; -100 effectively bans a token, 100 forces it (vLLM applies it first too).
* :func:`apply_penalties`: repetition penalty (CTRL, Keskar et al. 2019, arXiv:1909.05858, with
  Hugging Face's sign rule over prompt + output tokens), then OpenAI's frequency and presence
  penalties over the output tokens only (``logit -= frequency * count + presence * (count > 0)``).
* :func:`apply_min_tokens`: EOS and ``stop_token_ids`` get ``-inf`` until ``min_tokens`` tokens.
* :func:`apply_top_k_top_p` and :func:`apply_min_p`: truncation of temperature-scaled logits, in
  Hugging Face's order (top-k, top-p of Holtzman et al. 2019, arXiv:1904.09751, then min-p of
  Nguyen et al. 2024, arXiv:2407.01082).

Python loops run over rows only, never over the vocabulary.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from replica.sample.metadata import SamplingMetadata

__all__ = ["apply_logit_bias", "apply_penalties", "apply_min_tokens", "apply_top_k_top_p", "apply_min_p"]


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host NumPy array as a tensor on ``device`` (no copy on CPU)."""
    return torch.from_numpy(np.ascontiguousarray(array)).to(device)


def apply_logit_bias(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Add each row's logit bias (``metadata.logit_bias``) to its logits; in place.

    Args:
        logits: ``[num_rows, V]`` float tensor; row ``i`` is ``metadata``'s row ``i``. Only the
            (row, token) pairs named by a bias change; rows without one are left as they are.
        metadata: the rows' settings. Token ids must be ``< V`` (the engine refuses others).
    """
    rows = np.flatnonzero(metadata.has_bias).tolist()
    if not rows:
        return logits
    biases = [metadata.logit_bias[i] for i in rows]
    row_ids = np.repeat(np.asarray(rows, dtype=np.int64), [len(b.token_ids) for b in biases])
    token_ids = np.concatenate([b.token_ids for b in biases])
    values = np.concatenate([b.biases for b in biases])
    device = logits.device
    index = (_tensor(row_ids, device), _tensor(token_ids, device))
    logits.index_put_(index, _tensor(values, device).to(logits.dtype), accumulate=True)
    return logits


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Apply repetition, frequency and presence penalties in place; return ``logits``.

    Args:
        logits: ``[num_rows, V]`` float tensor; row ``i`` is ``metadata``'s row ``i``. Modified in
            place (only the rows with a penalty set, ``metadata.penalized``).
        metadata: the rows' penalties, ``prompt_token_ids`` and ``output_token_ids`` (tokens
            generated before this step).

    Semantics per penalized row, in this order (as vLLM):
        * repetition (CTRL / HF): for every token in prompt + output,
          ``logit / r`` if ``logit > 0`` else ``logit * r``;
        * frequency / presence (OpenAI): ``logit -= f * count + p * (count > 0)``, where
          ``count[t]`` is how often ``t`` occurs in the *output* tokens.
    """
    rows = np.flatnonzero(metadata.penalized)
    if not len(rows):
        return logits
    vocab = logits.shape[-1]
    device = logits.device
    row_index = _tensor(rows, device)
    sub = logits.index_select(0, row_index)  # [n, V]
    n = len(rows)
    outputs = [np.asarray(metadata.output_token_ids[i], dtype=np.int64) for i in rows.tolist()]

    def occurrences(token_lists: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, token) index pairs of all tokens in ``token_lists``, flattened."""
        row_ids = np.repeat(np.arange(n, dtype=np.int64), [len(t) for t in token_lists])
        tokens = np.concatenate(token_lists) if token_lists else np.zeros(0, dtype=np.int64)
        return _tensor(row_ids, device), _tensor(tokens.astype(np.int64, copy=False), device)

    # Repetition penalty over prompt + output tokens (rows with r == 1 are left as they are).
    rep = _tensor(metadata.repetition_penalty[rows], device)
    if bool((rep != 1.0).any()):
        seen = torch.zeros(n, vocab, dtype=torch.bool, device=device)
        prompts = [metadata.prompt_token_ids[i] for i in rows.tolist()]
        seen[occurrences([np.concatenate([p, o]) for p, o in zip(prompts, outputs)])] = True
        r_col = rep.unsqueeze(1)
        penalized = torch.where(sub > 0, sub / r_col, sub * r_col)
        sub = torch.where(seen, penalized, sub)

    # Frequency and presence penalties over output tokens only.
    freq = _tensor(metadata.frequency_penalty[rows], device)
    pres = _tensor(metadata.presence_penalty[rows], device)
    if bool((freq != 0).any() or (pres != 0).any()):
        counts = torch.zeros(n, vocab, dtype=torch.float32, device=device)
        row_ids, token_ids = occurrences(outputs)
        counts.index_put_((row_ids, token_ids), torch.ones_like(token_ids, dtype=torch.float32), accumulate=True)
        sub = sub - freq.unsqueeze(1) * counts - pres.unsqueeze(1) * (counts > 0).float()

    logits.index_copy_(0, row_index, sub.to(logits.dtype))
    return logits


def apply_min_tokens(logits: torch.Tensor, metadata: SamplingMetadata, below: np.ndarray | None = None) -> torch.Tensor:
    """Mask each row's end ids (EOS unless ``ignore_eos``, and ``stop_token_ids``:
    ``metadata.end_ids``) to ``-inf`` while it has fewer output tokens than ``min_tokens``; in place.

    Args:
        logits: ``[num_rows, V]``; row ``i`` is ``metadata``'s row ``i``.
        below: ``[num_rows]`` bool, :meth:`SamplingMetadata.below_min_tokens` when the caller has it.
    """
    below = metadata.below_min_tokens() if below is None else below
    row_ids: list[int] = []
    token_ids: list[int] = []
    vocab = logits.shape[-1]
    for i in np.flatnonzero(below).tolist():
        banned = metadata.min_tokens_banned(i, vocab, True)
        row_ids.extend([i] * len(banned))
        token_ids.extend(banned)
    if row_ids:
        logits[torch.tensor(row_ids, device=logits.device), torch.tensor(token_ids, device=logits.device)] = -math.inf
    return logits


# Top-p first looks for the nucleus among this many most likely tokens (a partial topk is far
# cheaper than sorting the whole vocabulary on CPU: docs/bench/cpu-speed.md, "Figures behind rules
# in the code"); rows whose nucleus reaches further are sorted.
TOP_P_CANDIDATES = 1024


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask tokens outside the top-k and then outside the nucleus to ``-inf`` (HF's order).

    Args:
        logits: ``[n, V]`` temperature-scaled logits (not modified).
        top_k: ``[n]`` long, ``1..V`` (``V`` = disabled for that row), or None for none.
        top_p: ``[n]`` float in ``(0, 1]`` (1 = disabled), or None for none.
    Returns:
        ``[n, V]`` new tensor. Top-k keeps every token whose logit is >= the k-th largest (ties
        kept). Top-p (Holtzman et al. 2019) then keeps the smallest set of most likely tokens
        whose renormalized probability mass reaches ``p``: token ``j`` stays iff the mass of the
        tokens more likely than ``j`` is ``< p`` (so the most likely token always stays). That is
        HF's and vLLM's rule (drop the ascending-sorted prefix whose cumulative mass is
        ``<= 1 - p``), computed on the top ``TOP_P_CANDIDATES`` tokens when the nucleus lies there.
    """
    vocab = logits.shape[-1]
    if top_k is not None and bool((top_k < vocab).any()):
        k_on = top_k < vocab  # [n]; a full-vocabulary topk for disabled rows would cost a sort
        max_k = int(top_k[k_on].max())
        top_values = logits.topk(max_k, dim=-1).values  # [n, max_k], descending
        kth = top_values.gather(1, (top_k.clamp(max=max_k) - 1).unsqueeze(1))  # [n, 1]
        logits = logits.masked_fill(logits < kth.masked_fill(~k_on.unsqueeze(1), -math.inf), -math.inf)
    if top_p is None or not bool((top_p < 1).any()):
        return logits
    p_on = (top_p < 1).unsqueeze(1)  # [n, 1]; p = 1 keeps everything (no rounding surprises)
    num_candidates = min(TOP_P_CANDIDATES, vocab)
    values = logits.topk(num_candidates, dim=-1).values  # [n, c], descending
    probs = (values - logits.logsumexp(dim=-1, keepdim=True)).exp()  # true probabilities
    mass_before = probs.cumsum(dim=-1) - probs  # mass of the more likely candidates
    keep = (mass_before < top_p.unsqueeze(1)) & (values > -math.inf)  # [n, c]
    keep[:, 0] = True
    threshold = values.gather(1, keep.sum(dim=-1, keepdim=True) - 1)  # [n, 1] smallest kept logit
    out = logits.masked_fill(logits < threshold.masked_fill(~p_on, -math.inf), -math.inf)
    # Rows whose last candidate is still kept may have a nucleus beyond the candidates: sort them.
    if num_candidates == vocab:
        return out
    spill = (keep[:, -1:] & p_on).squeeze(1).nonzero().squeeze(1)
    if spill.numel():
        out.index_copy_(0, spill, _top_p_by_sort(logits.index_select(0, spill), top_p.index_select(0, spill)))
    return out


def _top_p_by_sort(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p with a full ascending sort (HF's formulation); ``logits`` ``[n, V]``, ``top_p`` ``[n]``."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)
    cum_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cum_probs <= (1 - top_p).unsqueeze(1)
    drop[:, -1] = False  # always keep the most likely token
    sorted_logits.masked_fill_(drop, -math.inf)
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Min-p sampling (Nguyen et al. 2024, arXiv:2407.01082): drop tokens with ``p < min_p * p_max``.

    Args:
        logits: ``[n, V]`` temperature-scaled logits (not modified).
        min_p: ``[n]`` in ``[0, 1]`` (0 = disabled).
    Works in logit space: ``p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p)``, which
    also makes it independent of any earlier renormalization by top-k / top-p.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p).unsqueeze(1)  # log(0) = -inf
    return logits.masked_fill(logits < threshold, -math.inf)
