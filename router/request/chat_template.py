"""Chat prompts in which a client's text stays text: only the chat template writes control tokens.

The model's chat template renders the messages to one string, and the tokenizer parses every
added-token string in it (``<|im_start|>``, ``<|im_end|>``, ...) as that token, wherever it came
from. A message whose content holds ``<|im_end|>\\n<|im_start|>system\\n...`` would close the
client's own turn and open a system turn. :class:`ChatEncoder` keeps such text plain:

1. No client string (message contents and every other message field, ``chat_template_kwargs``
   values, and the keys of every object among them, such as a tool's property names) holds
   control-token text, the usual case: render and encode the whole text, exactly as
   before.
2. Otherwise wrap each control-token string in the client's strings in private-use markers and
   render. Split the text at the unmarked control tokens, which only the template wrote, and emit
   their ids; a piece between two of them that holds marked text is encoded as plain text (the
   tokenizer's model alone, no added tokens), the others as before. Templates that trim, split or
   repeat a content keep the markers, and the client's text tokenizes with its neighbours, as
   plain text would.
3. Fail safe: render again with each of those strings replaced by a neutral character. Both renders
   must hold the same template control tokens (else the template lost a marker, or wrote control
   tokens because of the client's text), and the ids exactly those tokens. Otherwise a 400 on
   ``messages.<i>.content``; the client's text is never parsed as control tokens.

Control tokens: the special tokens and every other added token except whitespace-only ones
(``"\\n\\n"``-style tokens are ordinary text and cannot open a turn). A client's text loses any
marker characters (U+F0000, U+F0001) it holds, only when it holds control-token text.

Not ``tokenizer.encode(..., split_special_tokens=True)``: transformers sets that as a flag on the
shared Rust tokenizer for the call, and prompts are encoded in worker threads, so a concurrent
``encode`` could reset the flag in between and parse the client's text after all.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any, Callable

from router.request.protocol import OpenAIError

_START, _END, _NEUTRAL = "\U000f0000", "\U000f0001", "\U000f0002"

Render = Callable[[list[dict[str, Any]], dict[str, Any]], str]
"""``render(messages, template_kwargs) -> text``: the model's template; raises OpenAIError."""
Encode = Callable[[str], list[int]]
"""``encode(text) -> ids``: the tokenizer's usual encoding (added tokens parsed, none added)."""


class ChatEncoder:
    """Renders and tokenizes chats so that the client's text never becomes control tokens.

    Args:
        tokenizer: a Hugging Face tokenizer (``added_tokens_decoder``; ``backend_tokenizer`` for
            plain-text encoding: without one, a chat holding control-token text is refused).
    """

    def __init__(self, tokenizer: Any) -> None:
        self._ids = {  # control-token string -> id
            tok.content: i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special or not tok.content.isspace()
        }
        alternatives = "|".join(map(re.escape, sorted(self._ids, key=len, reverse=True))) or "(?!)"
        self._id_set = set(self._ids.values())
        self._control_re = re.compile(alternatives)
        # A marked token (group 1), a token the template wrote (group 2), or a lone marker.
        self._piece_re = re.compile(f"{_START}({alternatives}){_END}|({alternatives})|[{_START}{_END}]")
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._plain_newline = self._plain_pipeline("\n") if self._backend is not None else []

    def encode(self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any], render: Render, encode: Encode) -> list[int]:
        """Render ``messages`` with the model's template and tokenize the text.

        Args:
            messages: the chat, one dict per message (``role``, ``content`` as a string, ...).
            template_kwargs: the client's extra template variables.
            render: the template, see :data:`Render`; called once, or twice when a client string
                holds control-token text.
            encode: the usual encoding, see :data:`Encode`.

        Returns:
            The prompt's token ids; the very ids of ``encode(render(...))`` when no client string
            holds control-token text.

        Raises:
            OpenAIError: 400 (``messages.<i>.content``, ``messages.<i>`` or
                ``chat_template_kwargs``) when control-token text cannot be kept as plain text;
                whatever ``render`` and ``encode`` raise.
        """
        param, token = self._first_control_text(messages, template_kwargs)
        if param is None:
            return encode(render(messages, template_kwargs))
        if self._backend is None:
            raise self._refusal(param, token)
        wrap = lambda m: f"{_START}{m.group()}{_END}"  # noqa: E731
        text = render(*self._rewrite((messages, template_kwargs), wrap))
        neutral = render(*self._rewrite((messages, template_kwargs), lambda m: _NEUTRAL))
        ids, written = self._encode_marked(text, encode)
        if written != Counter(self._control_re.findall(neutral)):
            raise self._refusal(param, token)  # the template lost a marker or reacted to the text
        if Counter(i for i in ids if i in self._id_set) != Counter({self._ids[t]: n for t, n in written.items()}):
            raise self._refusal(param, token)  # the tokenizer made a control token of plain text
        return ids

    def _first_control_text(self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any]) -> tuple[str | None, str]:
        """(param, token) of the first client string holding control-token text, else (None, "")."""
        fields = [(f"messages.{i}.content", m.get("content")) for i, m in enumerate(messages)]
        fields += [(f"messages.{i}", {k: v for k, v in m.items() if k != "content"}) for i, m in enumerate(messages)]
        fields.append(("chat_template_kwargs", template_kwargs))
        for param, value in fields:
            for s in _strings(value):
                if found := self._control_re.search(s):
                    return param, found.group()
        return None, ""

    def _rewrite(self, obj: Any, replace: Callable[[re.Match[str]], str]) -> Any:
        """A copy of ``obj`` whose strings, dict keys included (a tool's property names reach the
        text through ``tojson``), lose their marker characters and have each control-token string
        replaced by ``replace(match)``."""
        if isinstance(obj, str):
            return self._control_re.sub(replace, obj.replace(_START, "").replace(_END, ""))
        if isinstance(obj, dict):
            return {self._rewrite(k, replace): self._rewrite(v, replace) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._rewrite(v, replace) for v in obj)
        return obj

    def _encode_marked(self, text: str, encode: Encode) -> tuple[list[int], Counter[str]]:
        """Encode a text rendered from marked strings; returns (ids, the control tokens the template
        wrote, counted). The text between two template control tokens (or lone markers, which a
        template that split a marked string leaves, and which break the text) is one piece."""
        ids: list[int] = []
        written: Counter[str] = Counter()
        piece: list[str] = []
        plain = False  # the piece holds marked text
        pos = 0
        for m in self._piece_re.finditer(text):
            piece.append(text[pos:m.start()])
            pos = m.end()
            if m.group(1) is not None:
                piece.append(m.group(1))
                plain = True
                continue
            ids += self._encode_piece("".join(piece), plain, encode, first=not ids)
            piece, plain = [], False
            if m.group(2) is not None:
                ids.append(self._ids[m.group(2)])
                written[m.group(2)] += 1
        piece.append(text[pos:])
        ids += self._encode_piece("".join(piece), plain, encode, first=not ids)
        return ids, written

    def _encode_piece(self, piece: str, plain: bool, encode: Encode, first: bool) -> list[int]:
        """Encode a piece of the text, as plain text if ``plain``. A piece after the start is encoded
        after a newline that is then dropped, so that a SentencePiece tokenizer does not add the
        space it adds at the start of a text."""
        if not piece:
            return []
        encode_fn = self._plain if plain else encode
        if first:
            return encode_fn(piece)
        newline = self._plain_newline if plain else encode("\n")
        ids = encode_fn("\n" + piece)
        return ids[len(newline):] if ids[: len(newline)] == newline else encode_fn(piece)

    def _plain(self, text: str) -> list[int]:
        try:
            return self._plain_pipeline(text)
        except Exception as exc:  # e.g. a lone UTF-16 surrogate
            raise OpenAIError(f"messages: the text cannot be tokenized: {exc}", param="messages", code="invalid_value") from None

    def _plain_pipeline(self, text: str) -> list[int]:
        """The tokenizer's normalizer, pre-tokenizer and model, without its added tokens."""
        backend = self._backend
        if backend.normalizer is not None:
            text = backend.normalizer.normalize_str(text)
        splits = [s for s, _ in backend.pre_tokenizer.pre_tokenize_str(text)] if backend.pre_tokenizer is not None else [text]
        return [t.id for s in splits for t in backend.model.tokenize(s)]

    @staticmethod
    def _refusal(param: str, token: str) -> OpenAIError:
        return OpenAIError(
            f"{param}: the text holds control-token text ({token!r}) that this model's chat template "
            "cannot keep as plain text; remove it",
            param=param,
            code="invalid_value",
        )


def _strings(obj: Any):
    """Every string in ``obj`` (a string, or dicts and lists of them; dict keys too), depth first."""
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _strings(v)
