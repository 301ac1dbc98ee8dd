"""Turn one step's logits into one token per row, vectorized over the batch.

The pipeline for a batch (``N`` rows, vocabulary ``V``), all in float32 (the logits processors of
steps 0, 1, 2 and 4 are in ``replica/sample/logits_processors.py``):

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
   output** (:func:`~replica.sample.grammar.apply_grammar_masks`): on the rows with a
   constraint, every token it forbids gets ``-inf``.
3. **Greedy rows** (``temperature == 0``, or below 1e-5 as in vLLM): ``torch.argmax`` of these
   logits, exactly what ``transformers``' greedy ``generate`` picks (it also applies its
   repetition penalty first).
4. **Random rows**: divide by the temperature, then truncate in Hugging Face's order: top-k,
   top-p (nucleus sampling, Holtzman et al. 2019, arXiv:1904.09751), min-p (Nguyen et al. 2024,
   arXiv:2407.01082; its mask is the same before or after top-k/top-p, being a ratio to p_max).
   Then draw. On CPU with Carpool's kernels built, by *inversion*
   (``carpool_cpu::sample_rows``, ``replica/kernels/csrc/cpu_sampling.cpp``): the first token whose
   running sum of ``probs`` exceeds ``u`` times their total, with one uniform ``u`` per row: one
   random number per row instead of one per token as in the race below (measured:
   ``docs/bench/cpu-speed.md``, "Random sampling and the served path's CPU per token").
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

from dataclasses import dataclass
from typing import Sequence

import torch
from torch.profiler import record_function

from replica.core.request import Request
from replica.kernels import cpu_kernels
from replica.protocol.outputs import TokenLogprobs
from replica.sample.grammar import apply_grammar_masks
from replica.sample.logits_processors import (
    apply_logit_bias,
    apply_min_p,
    apply_min_tokens,
    apply_penalties,
    apply_top_k_top_p,
    min_tokens_banned,
    needs_penalties,
)
from replica.sample.logprobs import token_logprobs

# Temperatures below this sample greedily (as vLLM's _SAMPLING_EPS): dividing by ~0 overflows.
GREEDY_TEMPERATURE_EPS = 1e-5

__all__ = ["Sampler", "SamplerOutput", "greedy_argmax", "cpu_inversion", "is_plain_greedy"]


@dataclass
class SamplerOutput:
    """One sampled token per row, and its logprobs where the request asked for them."""

    token_ids: list[int]  # [num_rows]
    logprobs: list[TokenLogprobs | None]  # [num_rows]; None where sampling_params.logprobs is None


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``argmax`` over the vocabulary of ``[rows, V]`` logits (the first index of the maximum):
    Carpool's CPU kernel for bf16 when built (torch's bf16 argmax is slower than its float32 one:
    ``docs/engine.md``, "Fast paths on CPU"), else float32 argmax (float32 holds every 16-bit
    value exactly)."""
    if logits.device.type == "cpu" and logits.dtype == torch.bfloat16 and cpu_kernels.available():
        return torch.ops.carpool_cpu.argmax_rows(logits)
    return logits.float().argmax(dim=-1)


def cpu_inversion() -> bool:
    """Whether random rows on CPU are drawn by Carpool's inversion kernel: yes wherever the CPU
    kernels build (built or loaded here if no one did yet), whatever the attention backend, so
    that a seed's tokens do not depend on which engine loaded them first."""
    return cpu_kernels.load()  # it returns its first answer


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


def is_plain_greedy(request: Request) -> bool:
    """Greedy, with nothing that needs float32 logits: no logit bias, no penalty, no min_tokens
    mask, no constraint, no logprobs."""
    p = request.sampling_params
    return (
        request.grammar is None
        and p.temperature < GREEDY_TEMPERATURE_EPS
        and p.logprobs is None
        and not p.logit_bias
        and not needs_penalties(request)
        and len(request.output_token_ids) >= p.min_tokens
    )



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
        token_ids, logprobs = self._run(logits, requests, with_logprobs=True)
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs)

    def sample_ids(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """The tokens :meth:`__call__` samples, as ``[num_rows]`` int64 on the logits' device, and no
        logprobs: nothing is read back to the host, so on CUDA the call returns before the
        device has sampled (async scheduling reads the tokens one step later)."""
        return self._run(logits, requests, with_logprobs=False)[0]

    def _run(
        self, logits: torch.Tensor, requests: Sequence[Request], *, with_logprobs: bool
    ) -> tuple[torch.Tensor, list[TokenLogprobs | None]]:
        """Token ids ``[num_rows]`` (int64, on the logits' device) and, ``with_logprobs``, the
        logprobs entries of the rows that ask for them (else all None)."""
        num_rows, vocab = logits.shape
        assert num_rows == len(requests), f"{num_rows} logit rows for {len(requests)} requests"
        plain = [is_plain_greedy(r) for r in requests]
        if all(plain):
            # The same tokens as the full path below, which takes argmax of the float32 logits.
            return greedy_argmax(logits).long(), [None] * num_rows
        if any(plain):
            # Plain greedy rows keep the fast argmax; only the others pay for float32 copies
            # (a constrained or biased neighbour costs them nothing).
            return self._split(logits, requests, plain, with_logprobs)
        device = logits.device
        raw = logits.float()
        work = raw
        needs_copy = any(
            r.sampling_params.logit_bias
            or needs_penalties(r)
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
                apply_grammar_masks(work, requests, lambda r: min_tokens_banned(r, vocab))

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

        if not with_logprobs:
            return token_ids, [None] * num_rows
        return token_ids, self._logprobs(raw, requests, token_ids)

    def _split(
        self, logits: torch.Tensor, requests: Sequence[Request], plain: list[bool], with_logprobs: bool
    ) -> tuple[torch.Tensor, list[TokenLogprobs | None]]:
        """Sample plain greedy rows (``plain[i]``) with :func:`greedy_argmax` and the rest with the
        full pipeline; the same tokens as the full pipeline over all rows."""
        fast = torch.tensor([i for i, p in enumerate(plain) if p], device=logits.device)
        rest = [i for i, p in enumerate(plain) if not p]
        rest_index = torch.tensor(rest, device=logits.device)
        rest_ids, rest_logprobs = self._run(
            logits.index_select(0, rest_index), [requests[i] for i in rest], with_logprobs=with_logprobs
        )
        token_ids = torch.empty(len(requests), dtype=torch.long, device=logits.device)
        token_ids[fast] = greedy_argmax(logits.index_select(0, fast)).long()
        token_ids[rest_index] = rest_ids
        logprobs: list[TokenLogprobs | None] = [None] * len(requests)
        for i, lp in zip(rest, rest_logprobs):
            logprobs[i] = lp
        return token_ids, logprobs

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
            # -log(U), U ~ Uniform[0, 1), is Exp(1) too and cheaper than exponential_() on CPU
            # (docs/bench/cpu-speed.md, "Figures behind rules in the code").
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
