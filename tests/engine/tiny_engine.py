"""What the engine behaviour tests share besides conftest's ``llm``, ``engine`` and ``base``
fixtures: the prompt, the context length, greedy parameters and a stop-string helper."""

from __future__ import annotations

from replica import SamplingParams

PROMPT = [101, 2020, 3030, 4040, 5050, 6060]
MAX_MODEL_LEN = 128
GREEDY = dict(temperature=0.0)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**GREEDY, **kw)


def boundary_stop(tokenizer, tokens, text) -> tuple[int, str, int]:
    """A stop string of 4 characters: 2 from the end of token ``i - 1`` and 2 from the start of token ``i``.

    Returns ``(i, stop, boundary)`` with ``boundary`` the text offset between the two tokens; the
    stop string occurs first exactly there.
    """
    offsets = [len(tokenizer.decode(tokens[:k])) for k in range(len(tokens) + 1)]
    for k in range(len(tokens) + 1):
        assert text.startswith(tokenizer.decode(tokens[:k]))
    for i in range(3, len(tokens) - 1):
        b = offsets[i]
        if b - offsets[i - 1] >= 2 and offsets[i + 1] - b >= 2:
            stop = text[b - 2 : b + 2]
            if text.find(stop) == b - 2:
                return i, stop, b
    raise AssertionError("no token boundary suitable for a stop string")
