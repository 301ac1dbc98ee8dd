"""Turn one step's logits into one token per row, vectorized over the batch.

The pipeline for a batch (``N`` rows, vocabulary ``V``), all in float32:

0. **Logit bias** (:func:`apply_logit_bias`), first, only on the rows that set one: OpenAI's
   ``logit_bias`` ``{token id: bias}`` is added to the logits (one ``index_put_`` over all
   (row, token) pairs); -100 effectively bans a token, 100 forces it. Same place as vLLM's.
1. **Penalties** (:func:`apply_penalties`), only on the rows that ask for them:
   repetition penalty (CTRL, Keskar et al. 2019, arXiv:1909.05858, with Hugging Face's sign rule:
   over prompt + output tokens, a positive logit is divided by the penalty, a negative one
   multiplied), then OpenAI's frequency and presence penalties over the *output* tokens only
   (``logit -= frequency * count + presence * (count > 0)``). Same order as vLLM.
2. **min_tokens** (:func:`apply_min_tokens`): EOS (unless ``ignore_eos``) and ``stop_token_ids``
   get ``-inf`` while fewer than ``min_tokens`` tokens have been generated. Then **structured
   output** (:func:`~replica.structured_output.apply_grammar_masks`): on the rows with a
   constraint, every token it forbids gets ``-inf``.
3. **Greedy rows** (``temperature == 0``, or below 1e-5 as in vLLM): ``torch.argmax`` of these
   logits, exactly what ``transformers``' greedy ``generate`` picks (it also applies its
   repetition penalty first).
4. **Random rows**: divide by the temperature, then truncate in Hugging Face's order: top-k,
   top-p (nucleus sampling, Holtzman et al. 2019, arXiv:1904.09751), min-p (Nguyen et al. 2024,
   arXiv:2407.01082; its mask is the same before or after top-k/top-p, being a ratio to p_max).
   Then draw. On CPU with Carpool's kernels built, by *inversion*
   (``carpool_cpu::sample_rows``, ``replica/csrc/cpu_sampling.cpp``): the first token whose
   running sum of ``probs`` exceeds ``u`` times their total, with one uniform ``u`` per row, about
   ten times faster than the race below (one random number per row instead of one per token).
   Elsewhere, with the *exponential race* that vLLM's sampler uses: ``argmax(probs / q)`` with
   ``q ~ Exp(1)`` i.i.d. per token, which draws token ``i`` with probability ``probs[i]`` (it is
   the Gumbel-max trick in disguise) and needs no CPU sync. Either way a seeded request draws only
   from its own ``torch.Generator``, so its samples do not depend on its batch mates or its row
   index; unseeded rows share one draw from the default generator. The two methods draw from the
   same distribution but not the same tokens for a seed: a seed reproduces its tokens among CPUs
   where Carpool's kernels build, or among machines that use the race, not across the two.
5. **Logprobs** (rows that ask): log-softmax of the *raw* logits (before logit bias, penalties
   and temperature, as vLLM reports them), the sampled token's logprob and rank, and the top ``k``.

Python loops run over rows only (a few hundred at most), never over the vocabulary.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch.profiler import record_function

from replica import cpu_kernels
from replica.logprobs import token_logprobs
from replica.model_loader import cache_dir
from replica.request import Request, TokenLogprobs
from replica.structured_output import apply_grammar_masks

# Temperatures below this sample greedily (as vLLM's _SAMPLING_EPS): dividing by ~0 overflows.
GREEDY_TEMPERATURE_EPS = 1e-5

__all__ = ["Sampler", "SamplerOutput", "apply_logit_bias", "apply_penalties", "apply_min_tokens", "apply_top_k_top_p", "apply_min_p"]


@dataclass
class SamplerOutput:
    """One sampled token per row, and its logprobs where the request asked for them."""

    token_ids: list[int]  # [num_rows]
    logprobs: list[TokenLogprobs | None]  # [num_rows]; None where sampling_params.logprobs is None


def _needs_penalties(request: Request) -> bool:
    p = request.sampling_params
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``argmax`` over the vocabulary of ``[rows, V]`` logits (the first index of the maximum):
    Carpool's CPU kernel for bf16 when built (torch's bf16 argmax is about 4x slower than its
    float32 one), else float32 argmax (float32 holds every 16-bit value exactly)."""
    if logits.device.type == "cpu" and logits.dtype == torch.bfloat16 and cpu_kernels.available():
        return torch.ops.carpool_cpu.argmax_rows(logits)
    return logits.float().argmax(dim=-1)


def cpu_inversion() -> bool:
    """Whether random rows on CPU are drawn by Carpool's inversion kernel: yes wherever the CPU
    kernels build (built or loaded here if no one did yet), whatever the attention backend, so
    that a seed's tokens do not depend on which engine loaded them first."""
    return cpu_kernels.available() or cpu_kernels.load(str(cache_dir() / "torch_extensions"))


def _row_uniforms(requests: Sequence[Request]) -> torch.Tensor:
    """One uniform draw in [0, 1) per row, ``[n]`` float64: a seeded request's from its own
    generator (so its draw does not depend on its batch mates), the others' from one draw of the
    default generator."""
    uniforms = torch.empty(len(requests), dtype=torch.float64)
    unseeded = [j for j, r in enumerate(requests) if r.generator is None]
    if len(unseeded) == len(requests):
        return uniforms.uniform_()
    if unseeded:
        uniforms[unseeded] = torch.rand(len(unseeded), dtype=torch.float64)
    for j, r in enumerate(requests):
        if r.generator is not None:
            uniforms[j] = torch.rand(1, dtype=torch.float64, generator=r.generator)
    return uniforms


def _plain_greedy(request: Request) -> bool:
    """Greedy, with nothing that needs float32 logits: no logit bias, no penalty, no min_tokens
    mask, no constraint, no logprobs."""
    p = request.sampling_params
    return (
        request.grammar is None
        and p.temperature < GREEDY_TEMPERATURE_EPS
        and p.logprobs is None
        and not p.logit_bias
        and not _needs_penalties(request)
        and len(request.output_token_ids) >= p.min_tokens
    )


def apply_logit_bias(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Add each row's ``sampling_params.logit_bias`` (``{token id: bias}``) to its logits; in place.

    Args:
        logits: ``[num_rows, V]`` float tensor; row ``i`` belongs to ``requests[i]``. Only the
            (row, token) pairs named by a bias change; rows without one are left as they are.
        requests: the rows' requests. Token ids must be ``< V`` (the engine refuses others).
    """
    row_ids: list[int] = []
    token_ids: list[int] = []
    biases: list[float] = []
    for i, r in enumerate(requests):
        bias = r.sampling_params.logit_bias
        if bias:
            row_ids.extend([i] * len(bias))
            token_ids.extend(bias.keys())
            biases.extend(bias.values())
    if row_ids:
        device = logits.device
        index = (torch.tensor(row_ids, device=device), torch.tensor(token_ids, dtype=torch.long, device=device))
        logits.index_put_(index, torch.tensor(biases, dtype=logits.dtype, device=device), accumulate=True)
    return logits


def apply_penalties(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Apply repetition, frequency and presence penalties in place; return ``logits``.

    Args:
        logits: ``[num_rows, V]`` float tensor; row ``i`` belongs to ``requests[i]``. Modified in
            place (only the rows whose request has a penalty set).
        requests: the rows' requests; ``prompt_token_ids`` and ``output_token_ids`` (tokens
            generated before this step) are read.

    Semantics per penalized row, in this order (as vLLM):
        * repetition (CTRL / HF): for every token in prompt + output,
          ``logit / r`` if ``logit > 0`` else ``logit * r``;
        * frequency / presence (OpenAI): ``logit -= f * count + p * (count > 0)``, where
          ``count[t]`` is how often ``t`` occurs in the *output* tokens.
    """
    rows = [i for i, r in enumerate(requests) if _needs_penalties(r)]
    if not rows:
        return logits
    vocab = logits.shape[-1]
    device = logits.device
    reqs = [requests[i] for i in rows]
    row_index = torch.tensor(rows, device=device)
    sub = logits.index_select(0, row_index)  # [n, V]
    n = len(reqs)

    def occurrences(token_lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, token) index pairs of all tokens in ``token_lists``, flattened."""
        lengths = torch.tensor([len(t) for t in token_lists], device=device)
        rows_ = torch.repeat_interleave(torch.arange(n, device=device), lengths)
        tokens = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long, device=device)
        return rows_, tokens

    # Repetition penalty over prompt + output tokens (rows with r == 1 are left as they are).
    rep = torch.tensor([r.sampling_params.repetition_penalty for r in reqs], device=device)
    if bool((rep != 1.0).any()):
        seen = torch.zeros(n, vocab, dtype=torch.bool, device=device)
        seen[occurrences([r.prompt_token_ids + r.output_token_ids for r in reqs])] = True
        r_col = rep.unsqueeze(1)
        penalized = torch.where(sub > 0, sub / r_col, sub * r_col)
        sub = torch.where(seen, penalized, sub)

    # Frequency and presence penalties over output tokens only.
    freq = torch.tensor([r.sampling_params.frequency_penalty for r in reqs], device=device)
    pres = torch.tensor([r.sampling_params.presence_penalty for r in reqs], device=device)
    if bool((freq != 0).any() or (pres != 0).any()):
        counts = torch.zeros(n, vocab, dtype=torch.float32, device=device)
        row_ids, token_ids = occurrences([r.output_token_ids for r in reqs])
        counts.index_put_((row_ids, token_ids), torch.ones_like(token_ids, dtype=torch.float32), accumulate=True)
        sub = sub - freq.unsqueeze(1) * counts - pres.unsqueeze(1) * (counts > 0).float()

    logits.index_copy_(0, row_index, sub.to(logits.dtype))
    return logits


def apply_min_tokens(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Mask EOS and stop token ids to ``-inf`` while ``len(output) < min_tokens``; in place.

    Args:
        logits: ``[num_rows, V]``; row ``i`` belongs to ``requests[i]``.
    EOS ids (``request.eos_token_ids``) are not masked when ``ignore_eos`` is set (they cannot end
    the request anyway); ``stop_token_ids`` always are.
    """
    row_ids: list[int] = []
    token_ids: list[int] = []
    vocab = logits.shape[-1]
    for i, r in enumerate(requests):
        p = r.sampling_params
        if len(r.output_token_ids) >= p.min_tokens:
            continue
        banned = set(p.stop_token_ids or ())
        if not p.ignore_eos:
            banned.update(r.eos_token_ids)
        banned = [t for t in banned if t < vocab]
        row_ids.extend([i] * len(banned))
        token_ids.extend(banned)
    if row_ids:
        logits[torch.tensor(row_ids, device=logits.device), torch.tensor(token_ids, device=logits.device)] = -math.inf
    return logits


# Top-p first looks for the nucleus among this many most likely tokens (a partial topk is ~20x
# cheaper than sorting a 50k vocabulary on CPU); rows whose nucleus reaches further are sorted.
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


class Sampler:
    """Sample one token per row of a step's logits (see the module docstring for the pipeline)."""

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> SamplerOutput:
        """Sample.

        Args:
            logits: ``[num_rows, V]``, any float dtype; row ``i`` belongs to ``requests[i]``.
                Not modified.
            requests: the rows' requests (``sampling_params``, ``prompt_token_ids``,
                ``output_token_ids`` before this sample, ``generator``, ``eos_token_ids``).
        Returns:
            :class:`SamplerOutput` with ``num_rows`` token ids and logprobs entries.
        """
        num_rows, vocab = logits.shape
        assert num_rows == len(requests), f"{num_rows} logit rows for {len(requests)} requests"
        plain = [_plain_greedy(r) for r in requests]
        if all(plain):
            # The same tokens as the full path below, which takes argmax of the float32 logits.
            token_list = greedy_argmax(logits).tolist()
            return SamplerOutput(token_ids=token_list, logprobs=[None] * num_rows)
        if any(plain):
            # Plain greedy rows keep the fast argmax; only the others pay for float32 copies
            # (a constrained or biased neighbour costs them nothing).
            return self._split(logits, requests, plain)
        device = logits.device
        raw = logits.float()
        work = raw
        needs_copy = any(
            r.sampling_params.logit_bias
            or _needs_penalties(r)
            or len(r.output_token_ids) < r.sampling_params.min_tokens
            or r.grammar is not None
            for r in requests
        )
        if needs_copy:
            work = raw.clone()  # raw stays untouched for logprobs
            apply_logit_bias(work, requests)
            apply_penalties(work, requests)
            apply_min_tokens(work, requests)
            with record_function("carpool.grammar_masks"):
                apply_grammar_masks(work, requests)

        token_ids = torch.empty(num_rows, dtype=torch.long, device=device)
        greedy = [r.sampling_params.temperature < GREEDY_TEMPERATURE_EPS for r in requests]
        greedy_rows = [i for i, g in enumerate(greedy) if g]
        random_rows = [i for i, g in enumerate(greedy) if not g]
        if greedy_rows:
            if len(greedy_rows) == num_rows:
                token_ids = work.argmax(dim=-1)
            else:
                index = torch.tensor(greedy_rows, device=device)
                token_ids[index] = work.index_select(0, index).argmax(dim=-1)
        if random_rows:
            index = torch.tensor(random_rows, device=device)
            raw_needed = raw is logits or any(r.sampling_params.logprobs is not None for r in requests)
            if len(random_rows) == num_rows and (work is not raw or not raw_needed):
                # Already our own copy (or a float32 conversion no one reads later), and no
                # greedy row reads it any more.
                owned = work
            else:
                owned = work.index_select(0, index)
            token_ids[index] = self._sample_random(owned, [requests[i] for i in random_rows])

        token_list = token_ids.tolist()
        return SamplerOutput(token_ids=token_list, logprobs=self._logprobs(raw, requests, token_ids))

    def _split(self, logits: torch.Tensor, requests: Sequence[Request], plain: list[bool]) -> SamplerOutput:
        """Sample plain greedy rows (``plain[i]``) with :func:`greedy_argmax` and the rest with the
        full pipeline; the same tokens as the full pipeline over all rows."""
        fast = [i for i, p in enumerate(plain) if p]
        rest = [i for i, p in enumerate(plain) if not p]
        device = logits.device
        fast_ids = greedy_argmax(logits.index_select(0, torch.tensor(fast, device=device))).tolist()
        full = self(logits.index_select(0, torch.tensor(rest, device=device)), [requests[i] for i in rest])
        token_ids: list[int] = [0] * len(requests)
        logprobs: list[TokenLogprobs | None] = [None] * len(requests)
        for i, t in zip(fast, fast_ids):
            token_ids[i] = t
        for i, t, lp in zip(rest, full.token_ids, full.logprobs):
            token_ids[i], logprobs[i] = t, lp
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)

    @staticmethod
    def _sample_random(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, then the draw (inversion on CPU, else the exponential
        race); ``[n]`` token ids.

        ``logits``: ``[n, V]`` float32, owned by this call (overwritten in place).
        """
        n, vocab = logits.shape
        device = logits.device
        params = [r.sampling_params for r in requests]
        if any(p.temperature != 1.0 for p in params):
            temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
            logits.div_(temperature.unsqueeze(1))  # the caller hands over a tensor it owns

        # Truncation: only on the rows that ask for it.
        trunc_rows = [j for j, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0]
        if trunc_rows:
            index = torch.tensor(trunc_rows, device=device)
            sub = logits.index_select(0, index)
            sub_params = [params[j] for j in trunc_rows]
            top_k = top_p = None
            if any(0 < p.top_k < vocab for p in sub_params):
                top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in sub_params], device=device)
            if any(p.top_p < 1.0 for p in sub_params):
                top_p = torch.tensor([p.top_p for p in sub_params], dtype=torch.float32, device=device)
            sub = apply_top_k_top_p(sub, top_k, top_p)
            if any(p.min_p > 0.0 for p in sub_params):
                sub = apply_min_p(sub, torch.tensor([p.min_p for p in sub_params], dtype=torch.float32, device=device))
            logits.index_copy_(0, index, sub)

        if device.type == "cpu" and cpu_inversion():
            return torch.ops.carpool_cpu.sample_rows(logits, _row_uniforms(requests))
        # Exponential race: with q ~ Exp(1) i.i.d., argmax(probs / q) ~ Categorical(probs). The
        # softmax's normalization does not change the argmax, so exp(x - max) stands in for probs.
        probs = logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()  # [n, V], in place
        q = torch.empty_like(probs)
        unseeded = [j for j, r in enumerate(requests) if r.generator is None]
        if unseeded:
            # -log(U), U ~ Uniform[0, 1), is Exp(1) too and ~4x faster than exponential_() on CPU.
            # (U = 0 gives q = inf: that one token sits out, a 2**-24-sized effect.)
            if len(unseeded) == n:
                q.uniform_().log_().neg_()
            else:
                index = torch.tensor(unseeded, device=device)
                q.index_copy_(0, index, torch.empty(len(unseeded), vocab, device=device).uniform_().log_().neg_())
        for j, r in enumerate(requests):
            if r.generator is not None:  # only this request's generator: batch-independent
                q[j] = torch.empty(vocab, device=device).exponential_(generator=r.generator)
        q.clamp_(min=torch.finfo(q.dtype).tiny)  # an Exp(1) draw can round to 0; avoid 0/0
        return probs.div_(q).argmax(dim=-1)

    @staticmethod
    def _logprobs(
        raw: torch.Tensor, requests: Sequence[Request], token_ids: torch.Tensor
    ) -> list[TokenLogprobs | None]:
        """Logprobs from the raw logits ``[num_rows, V]`` for rows whose request sets ``logprobs``."""
        out: list[TokenLogprobs | None] = [None] * len(requests)
        rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        if not rows:
            return out
        index = torch.tensor(rows, device=raw.device)
        ks = [requests[i].sampling_params.logprobs for i in rows]
        for i, entry in zip(rows, token_logprobs(raw.index_select(0, index), token_ids.index_select(0, index), ks)):
            out[i] = entry
        return out
