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

import json
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:  # torch and NumPy load where masks are applied (the sampler), not with the
    import torch   # request types: the scheduler and the ingress stay free of torch

DEAD_END = "structured output dead end: no token can continue the constraint"
"""``stop_reason`` of a constrained request that ended because no allowed token could be sampled."""

KINDS = ("json", "json_object", "regex", "choice", "grammar")

MAX_CHOICE_CHARS = 100_000
"""Characters of one ``choice`` string at most. llguidance's lexer compiles a longer one but then
gives up at the first token ("too many expressions constructed", from about 550,000 characters of
one string): a dead end where a 400 belongs. 20 strings of 100,000 characters work."""

JSON_FORMAT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
"""How constrained JSON is laid out (llguidance's ``x-guidance`` options): one line, the
separators of ``json.dumps``. Flexible whitespace lets a small model pad with newlines and spaces
until ``max_tokens`` cuts its JSON short."""


@dataclass
class StructuredOutputsParams:
    """One constraint on a request's output; exactly one field is set (vLLM's
    ``StructuredOutputsParams``).

    Attributes:
        json: a JSON schema (a dict, or its JSON text): the output is one JSON value valid under it.
        json_object: the output is one JSON object (OpenAI's ``response_format: json_object``).
        regex: the output matches this regular expression (Rust ``regex`` syntax, anchored).
        choice: the output is exactly one of these strings.
        grammar: a Lark grammar in llguidance's dialect (``%json {...}`` embeds a schema).
        field: the request field the constraint came from (``guided_regex``,
            ``response_format.json_schema.schema``, ...), named by errors; default
            ``structured_outputs.<kind>``. Not part of the constraint (:meth:`key`).
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    field: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check the shape (not the grammar itself: :func:`grammar_error` does that).

        Raises:
            ValueError: naming the field: none or several set, a field of the wrong type, or a
                ``choice`` string longer than :data:`MAX_CHOICE_CHARS`.
        """
        chosen = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError(f"structured_outputs: exactly one of {', '.join(KINDS)} must be set, got {chosen or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object), got {type(self.json).__name__}")
        if not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be a boolean")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            if (longest := max(map(len, self.choice))) > MAX_CHOICE_CHARS:
                raise ValueError(f"structured_outputs.choice: each string may hold at most {MAX_CHOICE_CHARS} characters, got {longest}")

    @property
    def kind(self) -> str:
        """The field that is set: one of :data:`KINDS`."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def source(self) -> str:
        """The request field errors name: :attr:`field`, else ``structured_outputs.<kind>``."""
        return self.field or f"structured_outputs.{self.kind}"

    def key(self) -> str:
        """A canonical text of the constraint (the compile cache's key): equal constraints, equal keys."""
        value = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, str):
            try:
                value = json.loads(value)
            except (ValueError, RecursionError):
                pass
        return self.kind + ":" + json.dumps(value, sort_keys=True, separators=(",", ":"))

    def to_grammar(self) -> str:
        """The llguidance grammar (its JSON text) of the constraint.

        Raises:
            ValueError: naming the field: a schema that is not JSON or not an object.
        """
        import llguidance

        kind = self.kind
        if kind in ("json", "json_object"):
            schema: Any = {"type": "object"} if kind == "json_object" else self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except (ValueError, RecursionError) as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise ValueError(f"structured_outputs.json must be a JSON schema (an object), got {type(schema).__name__}")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_FORMAT)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if kind == "choice":
            return llguidance.LLMatcher.grammar_from_regex(choice_regex(self.choice))
        return llguidance.LLMatcher.grammar_from_lark(self.grammar)


REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")
"""The characters Rust's ``regex`` syntax gives a meaning to (``regex_syntax::is_meta_character``);
any other character stands for itself."""


def choice_regex(choices: Sequence[str]) -> str:
    """A regular expression matching exactly the strings of ``choices``: each escaped
    (:data:`REGEX_META`) and joined as one alternation.

    llguidance's own ``choice`` grammar makes each string a parser item: it compiles in time that
    grows faster than the list (7.6 s for 70,000 strings) and refuses any step of 2,000 items or
    more, so every list of 2,000 strings or more ended at its first token. As one regular
    expression the list is one lexeme: about 12 microseconds a string, with no such limit.
    """
    return "(?:" + "|".join("".join("\\" + c if c in REGEX_META else c for c in s) for s in choices) + ")"


_WRAPPER_CONTEXT = re.compile(r"\n +\d+ \| start: .*", re.DOTALL)  # the grammar line a regex was wrapped in, and its caret
_WRAPPER_POSITION = re.compile(r"^at \d+\(\d+\): ")  # a position in that wrapper, not in the client's text

NO_OUTPUT = "no output satisfies it (it matches nothing the model's tokens can spell)"
"""What llguidance's bare ``NoExtensionBias`` (no token may start the output) means to a client."""


def llguidance_reason(error: str, kind: str | None = None) -> str:
    """llguidance's error text for a client, at most 500 characters: without what it appends for
    its developers (its parser state, a Rust backtrace); for a ``regex`` or ``choice`` (``kind``),
    without the one-line grammar Carpool wrapped it in (``start: /.../``) and positions in it;
    ``NoExtensionBias`` explained (:data:`NO_OUTPUT`)."""
    for marker in ("<state>", "<backtrace>"):
        error = error.split(marker, 1)[0]
    error = error.strip()
    if kind in ("regex", "choice"):
        error = _WRAPPER_POSITION.sub("", _WRAPPER_CONTEXT.sub("", error))
    if error == "NoExtensionBias":
        error = f"{NO_OUTPUT} (llguidance: NoExtensionBias)"
    return error[:500]


def grammar_error(params: StructuredOutputsParams) -> str | None:
    """Why ``params`` cannot be compiled (llguidance's message), or None if it can. Needs no
    tokenizer, so the ingress checks constraints before any replica sees them."""
    import llguidance

    try:
        grammar = params.to_grammar()
    except (ValueError, TypeError) as exc:
        return str(exc)
    error = llguidance.LLMatcher.validate_grammar(grammar, None)
    return llguidance_reason(error, params.kind) if error else None


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
        if self._ll_tokenizer is None:  # ~0.4 s: the tokenizer's vocabulary as a token trie
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
    is token ``t``), about 10x faster than shifting int32 words with torch; on other devices the
    packed mask is copied over (32x smaller) and unpacked there with shifts.
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
    logits: torch.Tensor, requests: Sequence[Any], banned: Callable[[Any], Sequence[int]]
) -> list[int]:
    """Set the logits of every token a row's constraint forbids to ``-inf``; in place.

    Args:
        logits: ``[num_rows, V]`` float; row ``i`` belongs to ``requests[i]``. Rows whose request
            has no ``grammar`` are not touched.
        requests: the rows' requests (``request.grammar``: a :class:`Grammar` or None).
        banned: ``banned(request)``: the token ids already at ``-inf`` in its row (the sampler
            passes :func:`~replica.logits_processors.min_tokens_banned`).
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
    rows = [i for i, r in enumerate(requests) if r.grammar is not None]
    if not rows:
        return rows
    import numpy as np
    import torch

    vocab = logits.shape[-1]
    bitmask = torch.full((len(rows), (vocab + 31) // 32), -1, dtype=torch.int32)
    words = bitmask.numpy().view(np.uint32)
    for k, i in enumerate(rows):
        requests[i].grammar.fill_bitmask(bitmask, k)
        if not _allows_any(words[k], vocab, banned(requests[i])):
            requests[i].grammar.dead_end = True
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
