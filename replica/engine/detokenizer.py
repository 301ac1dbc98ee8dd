"""Incremental detokenization with stop strings, one instance per request.

Token ids become text through ``tokenizers.decoders.DecodeStream``, the tokenizers library's own
incremental decoder: it keeps a small window of recent ids, decodes the window, and returns only
the new suffix, holding ids back (returns ``None``) while the window's text ends in a partial
UTF-8 character. It is primed with the last few prompt ids, so that the first output token decodes
*in context* (a SentencePiece ``▁word`` keeps its leading space after a prompt, as it would inside
a full decode). Cost per token: one decode of a window of a few ids.

Stop strings are matched on the text, across token boundaries. While a request runs, the last
``max(len(s) for s in stop) - 1`` characters are held back (they could be the start of a stop
string), so a stop string never leaks into a streamed delta; a finished request flushes them.
The stop scan looks only at the new text plus that tail. With ``include_stop_str_in_output`` no
text needs holding back: the stop string stays in the output, and the text is cut right after it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from replica.protocol.sampling_params import SamplingParams

__all__ = ["DetokenizerUpdate", "IncrementalDetokenizer"]

# How many prompt ids prime the decode stream (vLLM and SGLang use 5 for their offset scheme).
PROMPT_CONTEXT_IDS = 8
# The message tokenizers raises when a window's decode stops extending the previous one
# (non-monotonic decoders; see vllm-project/vllm#17448). It is an untyped Exception.
_INVALID_PREFIX = "Invalid prefix encountered"
_REPLACEMENT = "\ufffd"


@dataclass
class DetokenizerUpdate:
    """What one :meth:`IncrementalDetokenizer.update` produced."""

    delta_text: str  # text safe to emit now
    stop_string: str | None  # the stop string that matched (the request ends with "stop")


def backend_tokenizer(tokenizer: Any) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` behind a transformers fast tokenizer (or the object itself)."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        raise TypeError(f"need a fast tokenizer backed by tokenizers.Tokenizer, got {type(tokenizer).__name__}")
    return backend


class IncrementalDetokenizer:
    """Turn a request's output tokens into text deltas, step by step.

    Args:
        tokenizer: a transformers fast tokenizer (or a ``tokenizers.Tokenizer``).
        prompt_token_ids: the request's prompt; its last few ids give the first token context.
        params: ``skip_special_tokens``, ``stop``, ``include_stop_str_in_output``,
            ``stop_token_ids``, ``ignore_eos``, ``min_tokens`` are read.
        eos_token_ids: ids that end the request (default: the tokenizer's ``eos_token_id``).

    A last token that ended the request as a stop token (one of ``stop_token_ids``, or EOS unless
    ``ignore_eos``) is not detokenized, unless ``include_stop_str_in_output`` (vLLM's rule), so
    EOS never shows up in the text even with ``skip_special_tokens=False``. As in vLLM, a stop
    string only counts if it ends after the text of the first ``min_tokens`` tokens.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        eos_token_ids: Sequence[int] | None = None,
    ) -> None:
        self._backend = backend_tokenizer(tokenizer)
        self._skip_special = params.skip_special_tokens
        self._stop: list[str] = list(params.stop or [])
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        max_stop_len = max((len(s) for s in self._stop), default=0)
        self._tail_len = max(max_stop_len - 1, 0)  # chars before new text a stop string can start in
        self._hold_back = 0 if self._include_stop else self._tail_len
        if eos_token_ids is None:
            eos = getattr(tokenizer, "eos_token_id", None)
            eos_token_ids = [eos] if isinstance(eos, int) else []
        self._stop_token_ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            self._stop_token_ids.update(eos_token_ids)

        context = list(prompt_token_ids[-PROMPT_CONTEXT_IDS:])
        if context and self._decode(context).endswith(_REPLACEMENT):
            context = []  # a prompt ending mid-character would leak its bytes into the output
        self._stream = DecodeStream(context, skip_special_tokens=self._skip_special)
        self._recent_ids: deque[int] = deque(context, maxlen=PROMPT_CONTEXT_IDS)  # decoded ids
        self._pending_ids: list[int] = []  # ids the stream holds (partial UTF-8 so far)

        self._num_tokens = 0
        self._min_tokens_text_len = 0  # len(text) once min_tokens tokens were decoded
        self._chunks: list[str] = []  # emitted deltas
        self._num_emitted = 0  # chars emitted
        self._emitted_tail = ""  # last _tail_len emitted chars (stop strings may start there)
        self._buffer = ""  # decoded, not yet emitted (held back)
        self._done = False
        self.stop_string: str | None = None

    @property
    def output_text(self) -> str:
        """All text so far (emitted + held back), cut at a matched stop string."""
        return "".join(self._chunks) + self._buffer

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def update(self, new_token_ids: Sequence[int], finished: bool) -> DetokenizerUpdate:
        """Decode ``new_token_ids``; check stop strings; return the text that is safe to emit.

        ``finished=True`` (the request ended on a token-level stop or length) flushes every
        held-back character, and any bytes of a character cut off by the end. After a stop string
        matched or a finished update, calling again raises ``RuntimeError``.
        """
        if self._done:
            raise RuntimeError("update() after the request finished or matched a stop string")
        ids = list(new_token_ids)
        skipped = finished and bool(ids) and not self._include_stop and ids[-1] in self._stop_token_ids
        if skipped:
            ids = ids[:-1]  # the token that ended the request stays out of the text
        old_len = self._num_emitted + len(self._buffer)
        for token_id in ids:
            self._buffer += self._step(token_id)
            self._num_tokens += 1
            if self._num_tokens <= self._min_tokens:
                self._min_tokens_text_len = self._num_emitted + len(self._buffer)
        self._num_tokens += skipped
        if finished:
            self._buffer += self._flush_pending()

        if self._stop:
            match = self._find_stop(boundary=max(old_len, self._min_tokens_text_len))
            if match is not None:
                stop, end = match  # end: absolute position where the kept text ends
                self._buffer = self._buffer[: end - self._num_emitted]
                self.stop_string = stop
                finished = True
        if finished:
            self._done = True
            return DetokenizerUpdate(self._emit(len(self._buffer)), self.stop_string)
        return DetokenizerUpdate(self._emit(max(len(self._buffer) - self._hold_back, 0)), None)

    # -- decoding -------------------------------------------------------------------------

    def _decode(self, ids: Sequence[int]) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=self._skip_special)

    def _step(self, token_id: int) -> str:
        """Feed one id to the stream; the new text ('' while a character is incomplete)."""
        try:
            text = self._stream.step(self._backend, token_id)
        except Exception as error:  # tokenizers raises an untyped Exception
            if not str(error).startswith(_INVALID_PREFIX):
                raise
            # Restart the stream from the ids it still held; the emitted text stays as it is.
            self._stream = DecodeStream(skip_special_tokens=self._skip_special)
            text = self._stream.step(self._backend, self._pending_ids + [token_id])
        if text is None:
            self._pending_ids.append(token_id)
            return ""
        self._recent_ids.extend(self._pending_ids)
        self._recent_ids.append(token_id)
        self._pending_ids.clear()
        return text

    def _flush_pending(self) -> str:
        """Text of ids the stream still holds at the end (a cut-off character decodes to U+FFFD)."""
        if not self._pending_ids:
            return ""
        context = list(self._recent_ids)
        prefix = self._decode(context)
        pending, self._pending_ids = self._pending_ids, []
        full = self._decode(context + pending)
        return full[len(prefix) :] if full.startswith(prefix) else self._decode(pending)

    # -- stop strings and emission -------------------------------------------------------

    def _find_stop(self, boundary: int) -> tuple[str, int] | None:
        """The stop string that ends first after absolute text position ``boundary``.

        Returns ``(stop, end_of_kept_text)`` or None. Only ``emitted tail + buffer`` is scanned:
        a match must end after ``boundary`` (in new text), so it starts at most
        ``max_len - 1`` characters before it. Earliest end wins, which is what a scan after every
        single character would find, whatever the token boundaries.
        """
        window = self._emitted_tail + self._buffer
        window_start = self._num_emitted - len(self._emitted_tail)  # absolute offset of window[0]
        best: tuple[int, str, int] | None = None  # (match end, stop, match start)
        for stop in self._stop:
            start_from = max(boundary - len(stop) + 1 - window_start, 0)
            at = window.find(stop, start_from)
            if at < 0:
                continue
            end = at + len(stop)
            if best is None or end < best[0]:
                best = (end, stop, at)
        if best is None:
            return None
        end, stop, at = best
        keep_until = window_start + (end if self._include_stop else at)
        assert keep_until >= self._num_emitted, "stop string reached into emitted text"
        return stop, keep_until

    def _emit(self, num_chars: int) -> str:
        """Move the first ``num_chars`` buffered characters out as a delta."""
        delta, self._buffer = self._buffer[:num_chars], self._buffer[num_chars:]
        if delta:
            self._chunks.append(delta)
            self._num_emitted += len(delta)
            if self._tail_len:
                self._emitted_tail = (self._emitted_tail + delta)[-self._tail_len :]
        return delta
