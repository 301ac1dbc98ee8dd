"""Incremental detokenizer: UTF-8 safety, special tokens, stop strings and hold-back."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models

from replica.engine.detokenizer import IncrementalDetokenizer
from replica.protocol.sampling_params import SamplingParams

TEXTS = [
    "Hello, world! This is a plain ASCII sentence.",
    "Emoji: 😀🎉👍🏽 and a family 👨‍👩‍👧‍👦 in one line.",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "Mixed: café naïve résumé — “quotes” and ‘apostrophes’ … ∑∫√π ≈ 3.14159",
    "Code:\n```python\ndef f(x):\n    return x ** 2  # square\n```\n\ttabs\tand  double  spaces ",
    "Ünïcödé mixed with 🚀 rockets and Ελληνικά and עברית and العربية.",
]
PROMPT = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk_sizes=None, finish=True) -> list[str]:
    """Feed ``ids`` in chunks (1 by default); the last update is ``finished``; return the deltas."""
    deltas = []
    i = 0
    rng = random.Random(0)
    while i < len(ids):
        n = 1 if chunk_sizes is None else rng.choice(chunk_sizes)
        chunk = ids[i : i + n]
        i += len(chunk)
        update = detok.update(chunk, finished=finish and i >= len(ids))
        deltas.append(update.delta_text)
        if update.stop_string is not None:
            break
    return deltas


@pytest.fixture(scope="module")
def prompt_ids(smollm2_tokenizer):
    return smollm2_tokenizer.encode(PROMPT)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk_sizes", [None, [1, 2, 3, 5]])
def test_deltas_concatenate_to_full_decode(smollm2_tokenizer, prompt_ids, text, chunk_sizes):
    tok = smollm2_tokenizer
    ids = tok.encode(text) + [tok.eos_token_id]
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams())
    deltas = stream(detok, ids, chunk_sizes)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == text
    assert detok.output_text == text
    assert all("\ufffd" not in d for d in deltas)


def test_multibyte_characters_split_across_tokens(smollm2_tokenizer, prompt_ids):
    tok = smollm2_tokenizer
    ids = tok.encode("😀日本")
    # byte-level BPE splits these characters' bytes across tokens
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams())
    deltas = [detok.update([i], finished=False).delta_text for i in ids]
    assert "" in deltas  # a token that only carries part of a character emits nothing yet
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == "😀日本"


def test_character_cut_off_by_the_end_is_flushed_as_in_full_decode(smollm2_tokenizer, prompt_ids):
    tok = smollm2_tokenizer
    ids = tok.encode("ok 😀")[:-1]  # the emoji's last byte never comes (e.g. max_tokens)
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams())
    deltas = stream(detok, ids)
    assert "".join(deltas) == tok.decode(ids) == detok.output_text
    assert "\ufffd" not in "".join(deltas[:-1])


def test_special_tokens(smollm2_tokenizer, prompt_ids):
    tok = smollm2_tokenizer
    ids = tok.encode("Hi<|im_end|> there") + [tok.eos_token_id]
    skipped = IncrementalDetokenizer(tok, prompt_ids, SamplingParams())
    assert "".join(stream(skipped, ids)) == "Hi there"
    kept = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(skip_special_tokens=False, ignore_eos=True))
    # with ignore_eos the final EOS is an ordinary token, kept in the text
    assert "".join(stream(kept, ids)) == "Hi<|im_end|> there<|im_end|>"


def test_eos_that_ends_the_request_is_not_in_text(smollm2_tokenizer, prompt_ids):
    tok = smollm2_tokenizer
    ids = tok.encode("The end.") + [tok.eos_token_id]
    for params in (SamplingParams(), SamplingParams(skip_special_tokens=False)):
        detok = IncrementalDetokenizer(tok, prompt_ids, params)
        assert "".join(stream(detok, ids)) == "The end." == detok.output_text
    # a stop token id that ends the request is left out too (vLLM's rule)
    stop_id = tok.encode(" Bye")[0]
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(stop_token_ids=[stop_id]))
    assert "".join(stream(detok, tok.encode("Done.") + [stop_id])) == "Done."


def test_stop_string_across_tokens_truncates_and_never_streams(smollm2_tokenizer, prompt_ids):
    tok = smollm2_tokenizer
    text = "The quick brown fox jumps over the lazy dog."
    ids = tok.encode(text)
    pieces = [tok.decode([i]) for i in ids]
    assert not any("own fo" in p for p in pieces)  # no single token holds it
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(stop=["own fo", "never"]))
    deltas = []
    for i, token_id in enumerate(ids):
        update = detok.update([token_id], finished=False)
        deltas.append(update.delta_text)
        # nothing emitted is ever taken back by the truncation
        assert "The quick br".startswith("".join(deltas))
        if update.stop_string is not None:
            break
    assert update.stop_string == "own fo"
    assert "".join(deltas) == "The quick br" == detok.output_text
    assert all("own" not in d for d in deltas)
    with pytest.raises(RuntimeError):
        detok.update([ids[-1]], finished=False)


def test_include_stop_str_in_output(smollm2_tokenizer, prompt_ids):
    tok = smollm2_tokenizer
    ids = tok.encode("The quick brown fox jumps over the lazy dog.")
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(stop="own fo", include_stop_str_in_output=True))
    deltas = stream(detok, ids, finish=False)
    assert detok.stop_string == "own fo"
    assert "".join(deltas) == "The quick brown fo" == detok.output_text


def test_stop_inside_one_token_and_earliest_match_wins(smollm2_tokenizer, prompt_ids):
    tok = smollm2_tokenizer
    ids = tok.encode("Hello world, hello moon")
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(stop=["moon", "ell"]))
    assert "".join(stream(detok, ids)) == "H" and detok.stop_string == "ell"
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(stop=["world, hello", "o w"]))
    assert "".join(stream(detok, ids)) == "Hell" and detok.stop_string == "o w"


def test_held_back_text_is_flushed_at_finish(smollm2_tokenizer, prompt_ids):
    tok = smollm2_tokenizer
    text = "Nothing here stops it"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(stop=["zzzz"]))
    streamed = "".join(detok.update([i], finished=False).delta_text for i in ids)
    assert streamed == text[:-3]  # the last len("zzzz") - 1 characters are held back
    assert detok.output_text == text
    final = detok.update([], finished=True)
    assert final.stop_string is None
    assert streamed + final.delta_text == text


def test_stop_string_ignored_within_min_tokens(smollm2_tokenizer, prompt_ids):
    tok = smollm2_tokenizer
    ids = tok.encode("stop here, then stop again")
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(stop=["stop"], min_tokens=2, max_tokens=20))
    assert "".join(stream(detok, ids)) == "stop here, then "


def sentencepiece_like_tokenizer() -> Tokenizer:
    """A Llama-2-style decoder (▁ for spaces, byte fallback, leading space stripped) on a toy vocab."""
    pieces = ["<unk>", "<s>", "▁Hi", "▁Hello", "▁world", "<0xE6>", "<0x97>", "<0xA5>", "!"]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.add_special_tokens(["<s>"])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return tok


def test_prompt_context_keeps_first_token_space_for_sentencepiece():
    tok = sentencepiece_like_tokenizer()
    output = [3, 4, 5, 6, 7, 8]  # "▁Hello▁world" + 日 (three byte tokens) + "!"
    detok = IncrementalDetokenizer(tok, [1, 2], SamplingParams())  # prompt "<s>▁Hi"
    deltas = stream(detok, output)
    assert "".join(deltas) == " Hello world日!"  # as the output reads after the prompt
    assert all("\ufffd" not in d for d in deltas)
    no_prompt = IncrementalDetokenizer(tok, [], SamplingParams())
    assert "".join(stream(no_prompt, output)) == tok.decode(output) == "Hello world日!"


def test_recovers_from_invalid_prefix_error(smollm2_tokenizer, prompt_ids):
    """tokenizers' DecodeStream can raise 'Invalid prefix encountered' (vllm#17448): restart."""
    tok = smollm2_tokenizer
    ids = tok.encode("one two three")

    class Failing:
        def step(self, tokenizer, token_id):
            raise Exception("Invalid prefix encountered while decoding stream.")

    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams())
    first = detok.update(ids[:1], finished=False).delta_text
    detok._stream = Failing()
    rest = stream(detok, ids[1:])
    assert first + "".join(rest) == "one two three"
