"""Structured output: grammar-constrained decoding with llguidance.

A request may carry a constraint (:class:`StructuredOutputsParams`, vLLM's names): a JSON schema,
any JSON object, a regular expression, a choice of strings, or a Lark grammar. llguidance
(github.com/guidance-ai/llguidance, the library vLLM's ``guidance`` backend and SGLang use)
turns it into a matcher over the model's vocabulary; the matcher computes which tokens may come
next (a bitmask, one bit per token id, 32 ids per ``int32`` word) and advances with each token.

Per step (:func:`apply_grammar_masks`, called by the sampler): the rows whose request has a
constraint get their bitmask filled by their matcher and every forbidden token's logit set to
``-inf``, before temperature and truncation, so greedy and random sampling both pick an allowed
token. Rows without a constraint are not touched (not copied, not read), so their tokens are
exactly what they would be alone.

After sampling, the scheduler hands each constrained request's token to its matcher
(:meth:`Grammar.accept`): a completed constraint ends the request (``stop``); a token the matcher
refuses (a dead end, which the mask makes unreachable unless other settings ban every allowed
token) ends it with ``abort`` and :data:`DEAD_END` as its ``stop_reason``.

Compilation (:class:`GrammarCompiler`) runs where requests are built, off the engine loop, and is
cached by constraint: a cached matcher is copied (microseconds) for each new request.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Sequence

from replica.protocol.constraints import StructuredOutputsParams, llguidance_reason

if TYPE_CHECKING:  # torch and NumPy load where masks are applied (the sampler), not with the
    import torch  # request types: the scheduler and the ingress stay free of torch



















class Grammar:
    """A request's constraint state: an llguidance matcher advanced token by token.

    Args:
        matcher: a fresh ``llguidance.LLMatcher`` (nothing consumed yet).
    """

    __slots__ = ("matcher", "dead_end")

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.dead_end = False  # the last mask left no token with a finite logit

    def accept(self, token_id: int) -> bool:
        """Advance over a sampled token; False if the constraint does not allow it, or if no token
        could be sampled (a dead end: whatever token the sampler returned is not taken)."""
        if self.dead_end:
            return False
        return bool(self.matcher.consume_token(token_id)) and not self.matcher.is_error()

    def rollback(self, num_tokens: int, dead_end: bool = False) -> None:
        """Undo the last ``num_tokens`` :meth:`accept` calls (speculative decoding verifies drafts
        on the constraint, then the scheduler accepts the kept tokens again), and set ``dead_end``
        back to what it was before them."""
        if num_tokens:
            self.matcher.rollback(num_tokens)
        self.dead_end = dead_end

    @property
    def is_finished(self) -> bool:
        """The constraint is complete: nothing but the end of the output may follow."""
        return bool(self.matcher.is_stopped())

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (``[rows, ceil(V / 32)]`` int32, on
        CPU, contiguous): bit ``t % 32`` of word ``t // 32`` is set iff token ``t`` is allowed."""
        v = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())


class GrammarCompiler:
    """Compiles constraints into :class:`Grammar` objects for one tokenizer, with a cache.

    Thread-safe: requests are built in worker threads and on the replica's event loop.

    Args:
        tokenizer: the model's Hugging Face fast tokenizer.
        vocab_size: the model's vocabulary (the logits' width, tokens); ids the tokenizer does not
            have are never allowed.
        cache_size: compiled constraints kept (least recently used dropped first).
        on_compile: called as ``on_compile(kind, seconds, cached)`` for every compilation asked for
            (metrics).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        cache_size: int = 512,
        on_compile: Callable[[str, float, bool], None] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self.on_compile = on_compile
        self._ll_tokenizer = None
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def _tokenizer(self) -> Any:
        if self._ll_tokenizer is None:  # once: the tokenizer's vocabulary as a token trie
            import llguidance.hf

            self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, self.vocab_size)
        return self._ll_tokenizer

    def compile(self, params: StructuredOutputsParams) -> Grammar:
        """A fresh :class:`Grammar` for ``params``.

        Raises:
            ValueError: naming the constraint's field (:attr:`StructuredOutputsParams.source`): it
                does not compile, or no token may start an output it allows (llguidance's message).
        """
        import llguidance

        key = params.key()
        started = time.perf_counter()
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
            ll_tokenizer = self._tokenizer()
        cached = template is not None
        if template is None:
            grammar = params.to_grammar()
            template = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
            error = template.get_error()
            if not error:  # a first mask: limits and empty grammars fail here, not mid-request
                trial = template.deep_copy()
                trial.compute_bitmask()
                error = trial.get_error()
            if error:
                raise ValueError(f"{params.source}: the constraint does not compile: {llguidance_reason(error, params.kind)}")
            with self._lock:
                self._cache[key] = template
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        matcher = template.deep_copy()
        if self.on_compile is not None:
            self.on_compile(params.kind, time.perf_counter() - started, cached)
        return Grammar(matcher)


def forbidden_tokens(bitmask: torch.Tensor, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[rows, ceil(V / 32)]`` int32 bitmask (on CPU) to a ``[rows, V]`` bool mask on ``device``,
    True where a token is *not* allowed.

    On CPU, NumPy's ``unpackbits`` over the little-endian bytes (bit ``t % 8`` of byte ``t // 8``
    is token ``t``), faster there than shifting int32 words with torch
    (``docs/bench/structured-output.md``, "Compiling constraints and unpacking masks"); on other
    devices the packed mask is copied over (an eighth of the bool mask's bytes) and unpacked there
    with shifts.
    """
    import numpy as np
    import torch

    if torch.device(device).type == "cpu":
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, bitorder="little")[:, :vocab_size]
        return torch.from_numpy(bits == 0)
    packed = bitmask.to(device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=packed.device)
    bits = (packed.unsqueeze(-1) >> shifts) & 1  # [rows, words, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size] == 0


def apply_grammar_masks(
    logits: torch.Tensor, grammars: Sequence[Grammar | None], banned: Callable[[int], Sequence[int]]
) -> list[int]:
    """Set the logits of every token a row's constraint forbids to ``-inf``; in place.

    Args:
        logits: ``[num_rows, V]`` float; row ``i``'s constraint is ``grammars[i]``. Rows without
            one (None) are not touched.
        grammars: the rows' constraints (:class:`Grammar` or None; ``SamplingMetadata.grammars``).
        banned: ``banned(i)``: the token ids already at ``-inf`` in row ``i`` (the sampler passes
            :meth:`~replica.sample.metadata.SamplingMetadata.min_tokens_banned`).
    Returns:
        The constrained rows, in order. A row whose constraint allows only banned tokens has no
        token left to sample: it marks its grammar
        ``dead_end`` (its request then ends with :data:`DEAD_END`). That is found from the host's
        bitmask, so the logits are never read back: with async scheduling, a step with
        constrained rows is sampled without waiting for its forward, like any other.

    The bitmasks are filled on the CPU (llguidance computes them there) and unpacked by
    :func:`forbidden_tokens`, not with ``llguidance.torch.apply_token_bitmask_inplace``, which is
    a ``torch.compile`` kernel: its first call compiles for seconds inside an engine step.
    """
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return rows
    import numpy as np
    import torch

    vocab = logits.shape[-1]
    bitmask = torch.full((len(rows), (vocab + 31) // 32), -1, dtype=torch.int32)
    words = bitmask.numpy().view(np.uint32)
    for k, i in enumerate(rows):
        grammars[i].fill_bitmask(bitmask, k)
        if not _allows_any(words[k], vocab, banned(i)):
            grammars[i].dead_end = True
    forbidden = forbidden_tokens(bitmask, vocab, logits.device)
    if len(rows) == logits.shape[0]:
        masked = logits.masked_fill_(forbidden, float("-inf"))
    else:
        index = torch.tensor(rows, device=logits.device)
        masked = logits.index_select(0, index).masked_fill_(forbidden, float("-inf"))
        logits.index_copy_(0, index, masked)
    return rows


def _allows_any(words, vocab_size: int, banned: Sequence[int]) -> bool:
    """Whether a row's bitmask ``words`` (``[ceil(V / 32)]`` uint32, NumPy) allows a token below
    ``vocab_size`` that is not in ``banned``."""
    import numpy as np

    left = words.copy()
    if vocab_size % 32:
        left[-1] &= np.uint32((1 << (vocab_size % 32)) - 1)  # bits past the vocabulary
    if len(banned):
        ids = np.asarray(banned, dtype=np.int64)
        np.bitwise_and.at(left, ids >> 5, ~(np.uint32(1) << (ids & 31).astype(np.uint32)))
    return bool(left.any())
