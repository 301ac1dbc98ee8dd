"""Structured-output constraints as a request carries them (vLLM's ``StructuredOutputsParams``), and their checks.

Plain Python, no torch: the ingress validates a request's constraint with :func:`grammar_error`
(llguidance compiles it); :mod:`replica.sample.grammar` turns it into token masks while decoding.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Sequence

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
    grows faster than the list and refuses any step of 2,000 items or more, so every list of 2,000
    strings or more ended at its first token. As one regular expression the list is one lexeme,
    with no such limit (both measured: ``docs/bench/structured-output.md``, "Compiling
    constraints and unpacking masks").
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
