"""Turn one step's logits into one token per row, vectorized over the batch.

The pipeline for a batch (``N`` rows, vocabulary ``V``), all in float32 (the logits processors of
steps 0, 1, 2 and 4 are in ``replica/sample/logits_processors.py``). Each row's settings come from
the step's :class:`~replica.sample.metadata.SamplingMetadata`, which the worker's persistent batch
gathers from its seats (:mod:`replica.worker.sampling_batch`):

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

import numpy as np
import torch
from torch.profiler import record_function

from replica.kernels import cpu_kernels
from replica.protocol.outputs import TokenLogprobs
from replica.sample.grammar import apply_grammar_masks
from replica.sample.logits_processors import (
    apply_logit_bias,
    apply_min_p,
    apply_min_tokens,
    apply_penalties,
    apply_top_k_top_p,
)
from replica.sample.logprobs import token_logprobs
from replica.sample.metadata import GREEDY_TEMPERATURE_EPS, SamplingMetadata

__all__ = ["Sampler", "SamplerOutput", "greedy_argmax", "cpu_inversion", "GREEDY_TEMPERATURE_EPS"]


@dataclass
class SamplerOutput:
    """One sampled token per row, and its logprobs where the request asked for them."""

    token_ids: list[int]  # [num_rows]
    logprobs: list[TokenLogprobs | None]  # [num_rows]; None where the row asks for no logprobs


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


def _row_uniforms(generators: list[torch.Generator | None]) -> torch.Tensor:
    """One uniform draw in [0, 1) per row, ``[n]`` float64: a seeded row's from its own generator
    (so its draw does not depend on its batch mates), the others' from one draw of the default
    generator."""
    uniforms = torch.empty(len(generators), dtype=torch.float64)
    unseeded = [j for j, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        return uniforms.uniform_()
    if unseeded:
        uniforms[unseeded] = torch.rand(len(unseeded), dtype=torch.float64)
    for j, g in enumerate(generators):
        if g is not None:
            uniforms[j] = torch.rand(1, dtype=torch.float64, generator=g)
    return uniforms


def _on(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(device)


class Sampler:
    """Sample one token per row of a step's logits (see the module docstring for the pipeline)."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample.

        Args:
            logits: ``[num_rows, V]``, any float dtype; row ``i`` is ``metadata``'s row ``i``.
                Not modified.
            metadata: the rows' settings, output tokens before this sample, generators (advanced
                by the draw) and constraints.
        Returns:
            :class:`SamplerOutput` with ``num_rows`` token ids and logprobs entries.
        Raises:
            AssertionError: ``logits`` and ``metadata`` have different row counts.
        """
        token_ids, logprobs = self._run(logits, metadata, with_logprobs=True)
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs)

    def sample_ids(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """The tokens :meth:`__call__` samples, as ``[num_rows]`` int64 on the logits' device, and no
        logprobs: nothing is read back to the host, so on CUDA the call returns before the
        device has sampled (async scheduling reads the tokens one step later)."""
        return self._run(logits, metadata, with_logprobs=False)[0]

    def _run(
        self, logits: torch.Tensor, md: SamplingMetadata, *, with_logprobs: bool
    ) -> tuple[torch.Tensor, list[TokenLogprobs | None]]:
        """Token ids ``[num_rows]`` (int64, on the logits' device) and, ``with_logprobs``, the
        logprobs entries of the rows that ask for them (else all None)."""
        num_rows, vocab = logits.shape
        assert num_rows == md.num_rows, f"{num_rows} logit rows for {md.num_rows} rows of sampling metadata"
        if md.all_plain_greedy:
            return greedy_argmax(logits).long(), [None] * num_rows
        below = md.below_min_tokens()
        plain = md.plain_greedy(below)
        if plain.all():
            # The same tokens as the full path below, which takes argmax of the float32 logits.
            return greedy_argmax(logits).long(), [None] * num_rows
        if plain.any():
            # Plain greedy rows keep the fast argmax; only the others pay for float32 copies
            # (a constrained or biased neighbour costs them nothing).
            return self._split(logits, md, plain, with_logprobs)
        device = logits.device
        raw = logits.float()
        work = raw
        if (md.has_bias | md.penalized | md.constrained | below).any():
            work = raw.clone()  # raw stays untouched for logprobs
            apply_logit_bias(work, md)
            apply_penalties(work, md)
            apply_min_tokens(work, md, below)
            with record_function("carpool.grammar_masks"):
                apply_grammar_masks(work, md.grammars, lambda i: md.min_tokens_banned(i, vocab, bool(below[i])))

        token_ids = torch.empty(num_rows, dtype=torch.long, device=device)
        greedy_rows = np.flatnonzero(md.greedy)
        random_rows = np.flatnonzero(~md.greedy)
        if len(greedy_rows):
            if len(greedy_rows) == num_rows:
                token_ids = work.argmax(dim=-1)
            else:
                index = _on(greedy_rows, device)
                token_ids[index] = work.index_select(0, index).argmax(dim=-1)
        if len(random_rows):
            index = _on(random_rows, device)
            raw_needed = raw is logits or md.any_logprobs
            if len(random_rows) == num_rows and (work is not raw or not raw_needed):
                # Already our own copy (or a float32 conversion no one reads later), and no
                # greedy row reads it any more.
                owned, random_md = work, md
            else:
                owned, random_md = work.index_select(0, index), md.select(random_rows)
            token_ids[index] = self._sample_random(owned, random_md)

        if not with_logprobs:
            return token_ids, [None] * num_rows
        return token_ids, self._logprobs(raw, md, token_ids)

    def _split(
        self, logits: torch.Tensor, md: SamplingMetadata, plain: np.ndarray, with_logprobs: bool
    ) -> tuple[torch.Tensor, list[TokenLogprobs | None]]:
        """Sample plain greedy rows (``plain[i]``) with :func:`greedy_argmax` and the rest with the
        full pipeline; the same tokens as the full pipeline over all rows."""
        fast = _on(np.flatnonzero(plain), logits.device)
        rest = np.flatnonzero(~plain)
        rest_index = _on(rest, logits.device)
        rest_ids, rest_logprobs = self._run(
            logits.index_select(0, rest_index), md.select(rest), with_logprobs=with_logprobs
        )
        token_ids = torch.empty(md.num_rows, dtype=torch.long, device=logits.device)
        token_ids[fast] = greedy_argmax(logits.index_select(0, fast)).long()
        token_ids[rest_index] = rest_ids
        logprobs: list[TokenLogprobs | None] = [None] * md.num_rows
        for i, lp in zip(rest.tolist(), rest_logprobs):
            logprobs[i] = lp
        return token_ids, logprobs

    @staticmethod
    def _sample_random(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, then the draw (inversion on CPU, else the exponential
        race); ``[n]`` token ids.

        ``logits``: ``[n, V]`` float32, owned by this call (overwritten in place); ``md``: its
        ``n`` rows' metadata.
        """
        n, vocab = logits.shape
        device = logits.device
        if (md.temperature != 1.0).any():
            logits.div_(_on(md.temperature, device).unsqueeze(1))  # the caller hands over a tensor it owns

        # Truncation: only on the rows that ask for it.
        k_on = (md.top_k > 0) & (md.top_k < vocab)
        p_on = md.top_p < 1.0
        m_on = md.min_p > 0.0
        trunc_rows = np.flatnonzero(k_on | p_on | m_on)
        if len(trunc_rows):
            index = _on(trunc_rows, device)
            sub = logits.index_select(0, index)
            top_k = top_p = None
            if k_on[trunc_rows].any():
                top_k = _on(np.where(k_on, md.top_k, vocab)[trunc_rows], device)
            if p_on[trunc_rows].any():
                top_p = _on(md.top_p[trunc_rows], device)
            sub = apply_top_k_top_p(sub, top_k, top_p)
            if m_on[trunc_rows].any():
                sub = apply_min_p(sub, _on(md.min_p[trunc_rows], device))
            logits.index_copy_(0, index, sub)

        generators = md.generators
        if device.type == "cpu" and cpu_inversion():
            return torch.ops.carpool_cpu.sample_rows(logits, _row_uniforms(generators))
        # Exponential race: with q ~ Exp(1) i.i.d., argmax(probs / q) ~ Categorical(probs). The
        # softmax's normalization does not change the argmax, so exp(x - max) stands in for probs.
        probs = logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()  # [n, V], in place
        q = torch.empty_like(probs)
        unseeded = [j for j, g in enumerate(generators) if g is None]
        if unseeded:
            # -log(U), U ~ Uniform[0, 1), is Exp(1) too and cheaper than exponential_() on CPU
            # (docs/bench/cpu-speed.md, "Figures behind rules in the code").
            # (U = 0 gives q = inf: that one token sits out, a 2**-24-sized effect.)
            if len(unseeded) == n:
                q.uniform_().log_().neg_()
            else:
                index = torch.tensor(unseeded, device=device)
                q.index_copy_(0, index, torch.empty(len(unseeded), vocab, device=device).uniform_().log_().neg_())
        for j, g in enumerate(generators):
            if g is not None:  # only this request's generator: batch-independent
                q[j] = torch.empty(vocab, device=device).exponential_(generator=g)
        q.clamp_(min=torch.finfo(q.dtype).tiny)  # an Exp(1) draw can round to 0; avoid 0/0
        return probs.div_(q).argmax(dim=-1)

    @staticmethod
    def _logprobs(raw: torch.Tensor, md: SamplingMetadata, token_ids: torch.Tensor) -> list[TokenLogprobs | None]:
        """Logprobs from the raw logits ``[num_rows, V]`` for rows that ask for them
        (``md.num_logprobs >= 0``)."""
        out: list[TokenLogprobs | None] = [None] * md.num_rows
        rows = np.flatnonzero(md.num_logprobs >= 0)
        if not len(rows):
            return out
        index = _on(rows, raw.device)
        ks = md.num_logprobs[rows].tolist()
        entries = token_logprobs(raw.index_select(0, index), token_ids.index_select(0, index), ks)
        for i, entry in zip(rows.tolist(), entries):
            out[i] = entry
        return out
