"""Structured output's building blocks (replica/sample/grammar.py), without a model: the
constraint's shape and cache key, grammar checks, bitmask unpacking, the logit masks and the
compile cache. The matchers are built over SmolLM2's tokenizer (vocabulary 49152)."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch

from replica.core.request import Request
from replica.protocol.constraints import JSON_FORMAT, KINDS, StructuredOutputsParams, grammar_error
from replica.protocol.sampling_params import SamplingParams
from replica.sample.grammar import Grammar, GrammarCompiler, apply_grammar_masks, forbidden_tokens
from replica.sample.logits_processors import apply_min_tokens
from replica.worker.sampling_batch import SamplingBatch

VOCAB = 49152
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
YES_NO = StructuredOutputsParams(choice=["yes", "no"])


@pytest.fixture(scope="module")
def compiler(smollm2_tokenizer) -> GrammarCompiler:
    """One compiler for the module: its tokenizer trie is built once (~0.5 s)."""
    return GrammarCompiler(smollm2_tokenizer, VOCAB)


def allowed_ids(grammar: Grammar, vocab: int = VOCAB) -> set[int]:
    bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    grammar.fill_bitmask(bitmask, 0)
    return set((~forbidden_tokens(bitmask, vocab))[0].nonzero().flatten().tolist())


def token_id(tokenizer, text: str) -> int:
    [tid] = tokenizer.convert_tokens_to_ids([text])
    assert tid is not None and tid != tokenizer.unk_token_id
    return tid


def yes_no_first_tokens(tokenizer) -> set[int]:
    """The tokens that can start "yes" or "no": y, ye, yes, n, no."""
    return {token_id(tokenizer, t) for t in ("y", "ye", "yes", "n", "no")}


# ---- StructuredOutputsParams -------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, kind",
    [
        (dict(json=SCHEMA), "json"),
        (dict(json=json.dumps(SCHEMA)), "json"),
        (dict(json={}), "json"),
        (dict(json_object=True), "json_object"),
        (dict(regex="[a-z]+"), "regex"),
        (dict(choice=["a", "b"]), "choice"),
        (dict(grammar='start: "a"'), "grammar"),
    ],
)
def test_exactly_one_field_gives_its_kind(fields, kind):
    assert StructuredOutputsParams(**fields).kind == kind
    assert set(KINDS) == {"json", "json_object", "regex", "choice", "grammar"}


@pytest.mark.parametrize(
    "fields",
    [dict(), dict(json_object=False), dict(json=SCHEMA, regex="a"), dict(choice=["a"], json_object=True),
     dict(regex="a", grammar='start: "a"')],
    ids=["none", "json-object-false", "json+regex", "choice+json-object", "regex+grammar"],
)
def test_none_or_several_fields_refused(fields):
    with pytest.raises(ValueError, match=r"structured_outputs: exactly one of json, json_object, regex, choice, grammar"):
        StructuredOutputsParams(**fields)


@pytest.mark.parametrize(
    "fields, field",
    [
        (dict(json=5), "json"),
        (dict(json=["a"]), "json"),
        (dict(json_object=1), "json_object"),
        (dict(json_object="yes"), "json_object"),
        (dict(regex=""), "regex"),
        (dict(regex=5), "regex"),
        (dict(grammar=""), "grammar"),
        (dict(grammar=b'start: "a"'), "grammar"),
        (dict(choice=[]), "choice"),
        (dict(choice="yes"), "choice"),
        (dict(choice=["yes", 1]), "choice"),
        (dict(choice=("yes", "no")), "choice"),
    ],
)
def test_wrong_types_refused_naming_the_field(fields, field):
    with pytest.raises(ValueError, match=rf"structured_outputs\.{field} must be"):
        StructuredOutputsParams(**fields)


def test_validate_catches_a_field_changed_after_construction():
    params = StructuredOutputsParams(regex="a")
    params.regex = 7
    with pytest.raises(ValueError, match=r"structured_outputs\.regex"):
        params.validate()
    with pytest.raises(ValueError, match=r"structured_outputs\.regex"):
        SamplingParams(structured_outputs=params)


def test_key_is_canonical_for_equal_schemas():
    a = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0}, "y": {"type": "string"}}, "required": ["x"]}
    b_text = '{"required": ["x"], "properties": {"y": {"type": "string"}, "x": {"minimum": 0, "type": "integer"}}, "type": "object"}'
    assert json.loads(b_text) == a
    key = StructuredOutputsParams(json=a).key()
    assert StructuredOutputsParams(json=b_text).key() == key
    assert StructuredOutputsParams(json=json.dumps(a, indent=2)).key() == key
    # Different constraints, different keys.
    assert StructuredOutputsParams(json={**a, "required": ["y"]}).key() != key
    assert StructuredOutputsParams(regex="a").key() != StructuredOutputsParams(grammar="a").key()
    assert StructuredOutputsParams(choice=["a", "b"]).key() != StructuredOutputsParams(choice=["b", "a"]).key()
    # Text that is not JSON still has a key (its error comes at compile time).
    assert StructuredOutputsParams(json="{not json").key() != StructuredOutputsParams(json="{not json!").key()


def test_sampling_params_take_a_dict_or_params_and_refuse_the_rest():
    p = SamplingParams(structured_outputs={"regex": "[0-9]+"})
    assert isinstance(p.structured_outputs, StructuredOutputsParams) and p.structured_outputs.regex == "[0-9]+"
    same = StructuredOutputsParams(choice=["a"])
    assert SamplingParams(structured_outputs=same).structured_outputs is same
    assert SamplingParams().structured_outputs is None
    with pytest.raises(ValueError, match=r"^structured_outputs: .*bogus"):
        SamplingParams(structured_outputs={"regex": "a", "bogus": 1})
    with pytest.raises(ValueError, match=r"structured_outputs: exactly one"):
        SamplingParams(structured_outputs={})
    with pytest.raises(ValueError, match=r"structured_outputs\.json must be"):
        SamplingParams(structured_outputs={"json": 3})
    with pytest.raises(ValueError, match=r"^structured_outputs must be a StructuredOutputsParams, got str"):
        SamplingParams(structured_outputs="[0-9]+")


# ---- grammar_error -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        StructuredOutputsParams(json=SCHEMA),
        StructuredOutputsParams(json=json.dumps(SCHEMA)),
        StructuredOutputsParams(json={"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "$defs": {"A": {"type": "integer"}}}),
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(regex=r"[A-Z][a-z]{2,8}"),
        StructuredOutputsParams(choice=["yes", "no"]),
        StructuredOutputsParams(grammar='start: "Answer: " NUM\nNUM: /[0-9]{1,3}/'),
        StructuredOutputsParams(grammar='start: "x" obj\nobj: %json {"type": "integer"}'),
    ],
    ids=["json", "json-text", "json-ref", "json-object", "regex", "choice", "lark", "lark-json"],
)
def test_grammar_error_none_for_valid_constraints(params):
    assert grammar_error(params) is None


@pytest.mark.parametrize(
    "params, words",
    [
        (StructuredOutputsParams(json={"type": "foo"}), ["foo"]),
        (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}), ["missing"]),
        (StructuredOutputsParams(json={"type": "string", "minLength": 5, "maxLength": 2}), ["minLength"]),
        (StructuredOutputsParams(json='{"type": "object"'), ["structured_outputs.json", "not valid JSON"]),
        (StructuredOutputsParams(json="[1, 2]"), ["structured_outputs.json", "object"]),
        (StructuredOutputsParams(regex="(abc"), ["unclosed group"]),
        (StructuredOutputsParams(grammar="start: foo"), ["foo"]),
        (StructuredOutputsParams(grammar="start: foo"), ["start: foo"]),  # a client's grammar keeps its line
        (StructuredOutputsParams(grammar='start: "a" bar\nbar: /[/'), ["regex"]),
    ],
    ids=["json-type", "json-ref", "json-unsatisfiable", "json-text-truncated", "json-text-array", "regex-group",
         "lark-name", "lark-line", "lark-regex"],
)
def test_grammar_error_explains_invalid_constraints(params, words):
    error = grammar_error(params)
    assert isinstance(error, str) and error
    for word in words:
        assert word in error


@pytest.mark.parametrize("params", [StructuredOutputsParams(regex="(abc"), StructuredOutputsParams(regex=r"\bx")])
def test_a_regex_error_does_not_show_the_grammar_it_was_wrapped_in(params):
    error = grammar_error(params)
    assert error and "start:" not in error and not error.startswith("at ")
    assert params.regex in error  # the client's own regex is quoted


# ---- forbidden_tokens ----------------------------------------------------------------------------


def signed(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


def pack(ids: set[int], words: int) -> list[int]:
    out = [0] * words
    for t in ids:
        out[t // 32] |= 1 << (t % 32)
    return [signed(w) for w in out]


def test_forbidden_tokens_against_a_hand_built_mask():
    vocab = 70  # 3 words, the last one partly past the vocabulary
    ids = {0, 1, 30, 31, 32, 33, 63, 64, 69}
    rows = [
        pack(ids, 3),
        pack({5, 70, 80, 95}, 3),  # bits past the vocabulary are dropped
        [-1, -1, -1],  # all allowed
        [0, 0, 0],
    ]
    assert rows[0][0] < 0  # bit 31 is the sign bit: it must still read as set
    forbidden = forbidden_tokens(torch.tensor(rows, dtype=torch.int32), vocab)
    assert forbidden.shape == (4, vocab) and forbidden.dtype == torch.bool and forbidden.device.type == "cpu"
    unpacked = ~forbidden
    assert set(unpacked[0].nonzero().flatten().tolist()) == ids
    assert unpacked[1].nonzero().flatten().tolist() == [5]
    assert bool(unpacked[2].all())
    assert not bool(unpacked[3].any())


# ---- apply_grammar_masks -----------------------------------------------------------------------


class FakeGrammar:
    """Allows a fixed set of ids (writes the hand-built bitmask)."""

    def __init__(self, ids: set[int]) -> None:
        self.ids = ids
        self.calls = 0
        self.dead_end = False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.calls += 1
        bitmask[row] = torch.tensor(pack(self.ids, bitmask.shape[1]), dtype=torch.int32)


def no_bans(row: int) -> list[int]:
    return []


def rows_of(*grammars):
    """The rows' constraints, as the sampler's metadata holds them."""
    return list(grammars)


def metadata_of(*grammars, params: SamplingParams, eos: tuple[int, ...], num_output: int):
    """The sampler's metadata of requests with these grammars, ``num_output`` tokens generated,
    gathered from a persistent batch's seats as in the engine."""
    seats = SamplingBatch(len(grammars))
    for seat, g in enumerate(grammars):
        request = Request(request_id=str(seat), prompt_token_ids=[1], sampling_params=params, eos_token_ids=eos,
                          output_token_ids=[1] * num_output)
        request.grammar = g
        seats.add(seat, request)
    return seats.gather(np.arange(len(grammars)))


def test_apply_grammar_masks_with_hand_built_masks():
    vocab = 70
    torch.manual_seed(0)
    logits = torch.randn(4, vocab)
    logits[3, 7] = float("-inf")  # an unconstrained row's own -inf stays as it is
    before = logits.clone()
    a, b = FakeGrammar({0, 31, 32, 69}), FakeGrammar({40})
    requests = rows_of(None, a, None, b)
    logits_ptr = logits.data_ptr()
    assert apply_grammar_masks(logits, requests, no_bans) == [1, 3]
    assert logits.data_ptr() == logits_ptr  # in place
    assert a.calls == b.calls == 1
    for row in (0, 2):
        assert torch.equal(logits[row], before[row])
    for row, ids in ((1, a.ids), (3, b.ids)):
        finite = set(torch.isfinite(logits[row]).nonzero().flatten().tolist())
        assert finite == ids
        keep = sorted(ids)
        assert torch.equal(logits[row, keep], before[row, keep])


def test_apply_grammar_masks_when_every_row_is_constrained():
    vocab = 70
    logits = torch.randn(2, vocab)
    before = logits.clone()
    ids = ({3, 31, 64}, {0, 69})
    assert apply_grammar_masks(logits, rows_of(*(FakeGrammar(i) for i in ids)), no_bans) == [0, 1]
    for row, allowed in enumerate(ids):
        assert set(torch.isfinite(logits[row]).nonzero().flatten().tolist()) == allowed
        keep = sorted(allowed)
        assert torch.equal(logits[row, keep], before[row, keep])


@pytest.mark.parametrize("num_output", [0, 2], ids=["before-min-tokens", "after"])
def test_a_dead_end_is_found_on_the_host_mask_without_reading_the_logits(num_output):
    """Until ``min_tokens``, the EOS and stop token ids are banned: a constraint that allows only
    those leaves no token (a dead end), one that allows another token too does not, and bits past
    the vocabulary count for nothing. The logits live on the meta device, which cannot be read
    back: the check uses the bitmask alone, so async scheduling never waits for a constrained
    step's forward."""
    vocab = 70
    params = SamplingParams(min_tokens=2, stop_token_ids=[40])
    only_banned, with_another, past_vocab = FakeGrammar({3, 40}), FakeGrammar({3, 40, 41}), FakeGrammar({40, 75, 95})
    rows = metadata_of(only_banned, None, with_another, past_vocab, params=params, eos=(3,), num_output=num_output)
    logits = torch.empty(4, vocab, device="meta")
    assert apply_grammar_masks(logits, rows.grammars, lambda i: rows.min_tokens_banned(i, vocab)) == [0, 2, 3]
    dead = [g.dead_end for g in rows.grammars if g is not None]
    assert dead == ([True, False, True] if num_output < 2 else [False, False, False])
    # The same verdict as the logits give once min_tokens and the masks are applied: a dead row
    # is one with every logit -inf.
    rows = metadata_of(*(FakeGrammar(g.ids) for g in (only_banned, with_another, past_vocab)), params=params, eos=(3,),
                       num_output=num_output)
    real = torch.randn(3, vocab)
    apply_min_tokens(real, rows)
    apply_grammar_masks(real, rows.grammars, lambda i: rows.min_tokens_banned(i, vocab))
    assert [g.dead_end for g in rows.grammars] == torch.isinf(real).all(dim=-1).tolist()


def test_apply_grammar_masks_leaves_unconstrained_batches_untouched():
    logits = torch.randn(3, 50)
    before = logits.clone()
    assert apply_grammar_masks(logits, rows_of(None, None, None), no_bans) == []
    assert torch.equal(logits, before)


def test_apply_grammar_masks_with_real_matchers(compiler, smollm2_tokenizer):
    torch.manual_seed(1)
    logits = torch.randn(3, VOCAB) * 5
    before = logits.clone()
    g = compiler.compile(YES_NO)
    requests = rows_of(None, g, None)
    assert apply_grammar_masks(logits, requests, no_bans) == [1]
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = yes_no_first_tokens(smollm2_tokenizer)
    assert set(torch.isfinite(logits[1]).nonzero().flatten().tolist()) == allowed
    keep = sorted(allowed)
    assert torch.equal(logits[1, keep], before[1, keep])
    # After "ye", only "s" (and nothing else) may follow.
    assert g.accept(token_id(smollm2_tokenizer, "ye"))
    logits = before.clone()
    apply_grammar_masks(logits, requests, no_bans)
    assert set(torch.isfinite(logits[1]).nonzero().flatten().tolist()) == {token_id(smollm2_tokenizer, "s")}


# ---- Grammar and GrammarCompiler ---------------------------------------------------------------


def test_compile_cache_hit_and_independent_matchers(smollm2_tokenizer):
    calls = []
    compiler = GrammarCompiler(smollm2_tokenizer, VOCAB, on_compile=lambda *a: calls.append(a))
    first = compiler.compile(YES_NO)
    second = compiler.compile(StructuredOutputsParams(choice=["yes", "no"]))  # an equal constraint
    assert [(kind, cached) for kind, _, cached in calls] == [("choice", False), ("choice", True)]
    assert all(seconds >= 0 for _, seconds, _ in calls)
    start = yes_no_first_tokens(smollm2_tokenizer)
    assert allowed_ids(first) == allowed_ids(second) == start

    # Advancing one leaves the other (and the cached template) where it was.
    assert first.accept(token_id(smollm2_tokenizer, "yes"))
    assert first.is_finished
    assert not second.is_finished
    assert allowed_ids(second) == start
    third = compiler.compile(YES_NO)
    assert calls[-1][2] is True
    assert not third.is_finished and allowed_ids(third) == start
    assert second.accept(token_id(smollm2_tokenizer, "n"))
    assert allowed_ids(second) == {token_id(smollm2_tokenizer, "o")}
    assert allowed_ids(third) == start


def test_accept_refuses_a_forbidden_token(compiler, smollm2_tokenizer):
    g = compiler.compile(YES_NO)
    assert not g.accept(token_id(smollm2_tokenizer, "x"))
    assert g.matcher.is_error()
    assert not g.accept(token_id(smollm2_tokenizer, "yes"))  # a dead end stays one


def test_json_layout_is_one_line_with_json_dumps_separators(compiler, smollm2_tokenizer):
    obj = {"name": "Tom", "age": 3}
    text = json.dumps(obj)
    assert text == '{"name": "Tom", "age": 3}' and JSON_FORMAT["whitespace_flexible"] is False
    g = compiler.compile(StructuredOutputsParams(json=SCHEMA))
    for tid in smollm2_tokenizer.encode(text):
        assert not g.is_finished
        assert g.accept(tid)
    assert g.is_finished

    def accepts(text: str) -> bool:
        g = compiler.compile(StructuredOutputsParams(json=SCHEMA))
        return all(g.accept(t) for t in smollm2_tokenizer.encode(text))

    assert not accepts('{"name":"Tom","age":3}')  # compact separators
    assert not accepts('{\n"name": "Tom"')  # newlines
    assert not accepts('{"name": "Tom", "age": 3, "x": 1}')  # additionalProperties: false
    assert not accepts('{"name": "Tomasinaaa"')  # maxLength 8


def test_bad_constraints_raise_value_error_naming_the_field(smollm2_tokenizer):
    calls = []
    compiler = GrammarCompiler(smollm2_tokenizer, VOCAB, on_compile=lambda *a: calls.append(a))
    bad = [
        (StructuredOutputsParams(regex="(abc"), r"(?s)structured_outputs\.regex: .*unclosed group"),
        # a regex no text matches: llguidance's bare NoExtensionBias, explained, under the client's field
        (StructuredOutputsParams(regex=r"[^\s\S]", field="guided_regex"), r"^guided_regex: .*no output satisfies it"),
        (StructuredOutputsParams(json={"type": "foo"}), r"structured_outputs\.json: .*foo"),
        (StructuredOutputsParams(json="{oops"), r"structured_outputs\.json is not valid JSON"),
        (StructuredOutputsParams(grammar="start: foo"), r"(?s)structured_outputs\.grammar: .*foo"),
    ]
    for params, pattern in bad:
        for _ in range(2):  # a failure is not cached as a success
            with pytest.raises(ValueError, match=pattern):
                compiler.compile(params)
    assert calls == []
    compiler.compile(YES_NO)
    assert [c[2] for c in calls] == [False]


def test_cache_drops_the_least_recently_used(smollm2_tokenizer):
    calls = []
    compiler = GrammarCompiler(smollm2_tokenizer, VOCAB, cache_size=2, on_compile=lambda *a: calls.append(a[2]))
    a, b, c = (StructuredOutputsParams(regex=r) for r in ("a+", "b+", "c+"))
    for params in (a, b, a, c, a, b):
        compiler.compile(params)
    # a miss, b miss, a hit, c miss (drops b, the least recently used), a hit, b miss.
    assert calls == [False, False, True, False, True, False]


def test_concurrent_compiles_give_working_independent_matchers(smollm2_tokenizer):
    calls = []
    compiler = GrammarCompiler(smollm2_tokenizer, VOCAB, on_compile=lambda *a: calls.append(a))
    results: list[Grammar] = []
    errors: list[BaseException] = []

    def work():
        try:
            results.append(compiler.compile(StructuredOutputsParams(json=SCHEMA)))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == len(calls) == 6
    assert len({id(g.matcher) for g in results}) == 6
    open_brace = smollm2_tokenizer.encode("{")[0]
    assert results[0].accept(open_brace)
    for g in results[1:]:
        assert allowed_ids(g) == allowed_ids(results[1])
    assert allowed_ids(results[0]) != allowed_ids(results[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the unpacking by shifts runs on non-CPU devices only")
def test_forbidden_tokens_same_on_the_gpu():
    vocab = 70
    rows = torch.tensor([pack({0, 31, 32, 69}, 3), pack({5, 70, 95}, 3), [-1, -1, -1], [0, 0, 0]], dtype=torch.int32)
    on_gpu = forbidden_tokens(rows, vocab, "cuda")
    assert on_gpu.device.type == "cuda"
    assert torch.equal(on_gpu.cpu(), forbidden_tokens(rows, vocab))
