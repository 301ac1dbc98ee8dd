"""OpenAI and vLLM logprobs objects from the replicas' :class:`~replica.protocol.outputs.TokenLogprobs`.

Three shapes: a completion choice's legacy ``logprobs`` (tokens, token_logprobs, top_logprobs,
text_offset), a chat choice's ``logprobs.content`` list, and vLLM's ``prompt_logprobs``. Tokens are
named by decoding each on its own, as vLLM and OpenAI do; ``-inf`` becomes ``-9999.0``.
"""

# No "from __future__ import annotations", as in router/ingress.py.

from typing import Any

from replica.protocol.outputs import TokenLogprobs

NEG_INF_LOGPROB = -9999.0  # JSON has no -inf; vLLM reports this value instead


def _finite(value: float) -> float:
    return value if value > NEG_INF_LOGPROB else NEG_INF_LOGPROB


class LogprobFormatter:
    """Formats one model's logprobs.

    Args:
        tokenizer: the model's tokenizer; each token is decoded on its own (up to 200,000 decoded
            tokens are kept).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._token_text: dict[int, str] = {}

    def token_str(self, token_id: int) -> str:
        """The text of ``token_id`` decoded alone (part of a character decodes to U+FFFD)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            if len(self._token_text) < 200_000:
                self._token_text[token_id] = text
        return text

    def completion(
        self,
        logprobs: list[TokenLogprobs],
        offset: int,
        prompt_ids: list[int] = (),
        prompt: list[TokenLogprobs | None] | None = None,
        k: int = 0,
    ) -> dict[str, Any]:
        """The legacy ``logprobs`` object of a completion choice: ``tokens``, ``token_logprobs``,
        ``top_logprobs`` and ``text_offset`` (characters), for the output tokens from ``offset``
        on; with ``prompt`` (echo: the prompt logprobs of ``prompt_ids``), first for the prompt
        tokens from offset 0, the first token's entries ``null``, each with at most ``k``
        alternatives, and the output tokens' offsets then continue from the prompt tokens' (the
        sum of the token strings, which is not the prompt text's length when a token decodes to
        part of a character)."""
        tokens, token_logprobs, tops, offsets = [], [], [], []
        prompt_offset = 0
        for token_id, lp in zip(prompt_ids, prompt or ()):
            token = self.token_str(token_id)
            if lp is None:  # the first prompt token: nothing comes before it
                value, top = None, None
            else:
                value = _finite(lp.logprob)
                top = {self.token_str(t): _finite(v) for t, v in lp.top[:k]}
                top.setdefault(token, value)
            tokens.append(token)
            token_logprobs.append(value)
            tops.append(top)
            offsets.append(prompt_offset)
            prompt_offset += len(token)
        if prompt is not None:
            offset = prompt_offset  # one running offset over prompt and output tokens, as vLLM
        for lp in logprobs:
            token = self.token_str(lp.token_id)
            tokens.append(token)
            token_logprobs.append(_finite(lp.logprob))
            top = {self.token_str(t): _finite(v) for t, v in lp.top}
            top.setdefault(token, _finite(lp.logprob))
            tops.append(top)
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}

    def prompt(self, entries: list[TokenLogprobs | None] | None, k: int | None) -> list[dict[str, Any] | None] | None:
        """vLLM's ``prompt_logprobs``: per prompt token ``null`` (the first) or a map from token id
        to ``{"logprob", "rank", "decoded_token"}`` holding the prompt token and its ``k`` top
        alternatives; None when ``k`` is None (not asked for)."""
        if entries is None or k is None:
            return None
        out: list[dict[str, Any] | None] = []
        for lp in entries:
            if lp is None:
                out.append(None)
                continue
            ranked = {t: (v, r) for r, (t, v) in enumerate(lp.top[:k], start=1)}
            ranked[lp.token_id] = (lp.logprob, lp.rank)
            out.append({
                str(t): {"logprob": _finite(v), "rank": r, "decoded_token": self.token_str(t)} for t, (v, r) in ranked.items()
            })
        return out

    def chat(self, logprobs: list[TokenLogprobs]) -> list[dict[str, Any]]:
        """A chat choice's ``logprobs.content``: per output token ``token``, ``logprob``, ``bytes``
        (its UTF-8 bytes) and ``top_logprobs`` (the same three for each alternative)."""
        def entry(token_id: int, value: float) -> dict[str, Any]:
            token = self.token_str(token_id)
            return {"token": token, "logprob": _finite(value), "bytes": list(token.encode("utf-8"))}

        return [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in logprobs
        ]
