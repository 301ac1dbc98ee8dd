"""A ``choice`` constraint (replica/sample/grammar.py, ``choice_regex``): the output is exactly one
of the listed strings, whatever characters they hold and however many there are, walked token by
token through real matchers over SmolLM2's tokenizer."""

from __future__ import annotations

import random
import string

import pytest
import torch

from replica.protocol.constraints import (
    MAX_CHOICE_CHARS,
    REGEX_META,
    StructuredOutputsParams,
    choice_regex,
    llguidance_reason,
)
from replica.sample.grammar import GrammarCompiler

VOCAB = 49152
# Every character Rust's regex syntax gives a meaning to, alone and in regex-looking strings, and
# characters that are plain in it: whitespace, NUL, non-ASCII.
ODD = [string.punctuation, "a b\tc\nd", "héllo 😀 日本", "x\x00y", "[a-z]+", "\\d", "a|b", "(?i)X", "x{2}", "^$", "#&-~"]


@pytest.fixture(scope="module")
def compiler(smollm2_tokenizer) -> GrammarCompiler:
    return GrammarCompiler(smollm2_tokenizer, VOCAB)


def walk(compiler: GrammarCompiler, tokenizer, choices: list[str], text: str) -> bool:
    """Whether the constraint takes ``text``'s tokens one by one, each allowed by the mask before
    it, and may end right after them."""
    grammar = compiler.compile(StructuredOutputsParams(choice=choices))
    mask = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)
    for token in tokenizer.encode(text, add_special_tokens=False):
        grammar.fill_bitmask(mask, 0)
        if not (int(mask[0, token // 32]) >> (token % 32)) & 1 or not grammar.accept(token):
            return False
    return bool(grammar.matcher.is_accepting())


def test_regex_escapes_exactly_the_meta_characters():
    assert REGEX_META == set("\\.+*?()|[]{}^$#&-~")
    assert choice_regex(["a.b", "c|d", "é"]) == r"(?:a\.b|c\|d|é)"


def test_each_listed_string_is_taken_as_written_and_nothing_else(compiler, smollm2_tokenizer):
    choices = ODD + ["", "option 1", "option 10"]
    for text in choices:
        assert walk(compiler, smollm2_tokenizer, choices, text), repr(text)
    # What the strings would match as patterns, or a prefix of one that is not itself listed.
    for text in ["abc", "7", "a", "X", "xx", "option 2", "option 100", "héllo"]:
        assert not walk(compiler, smollm2_tokenizer, choices, text), repr(text)


def test_lists_of_thousands_of_strings_work(compiler, smollm2_tokenizer):
    """llguidance's own choice grammar refused any step of 2,000 items or more: every list that
    long ended at its first token, and compiling grew faster than the list."""
    choices = [f"label {i} of the list" for i in range(5000)]
    for i in random.Random(0).sample(range(5000), 4) + [0, 4999]:
        assert walk(compiler, smollm2_tokenizer, choices, choices[i])
    assert not walk(compiler, smollm2_tokenizer, choices, "label 5000 of the list")


def test_llguidance_reason_keeps_only_the_message():
    assert llguidance_reason("panic: too big\n<backtrace>\n 0: <unknown>\n") == "panic: too big"
    assert llguidance_reason("Parser Error: no match\n<state>\nTokens: x") == "Parser Error: no match"
    assert llguidance_reason("x" * 600) == "x" * 500


def test_a_string_longer_than_the_lexer_can_walk_is_refused_up_front():
    StructuredOutputsParams(choice=["a" * MAX_CHOICE_CHARS])
    with pytest.raises(ValueError, match=r"^structured_outputs.choice: each string may hold at most 100000 characters, got 100001"):
        StructuredOutputsParams(choice=["yes", "a" * (MAX_CHOICE_CHARS + 1)])
