"""Checks of a request body before any replica is asked: the server's caps
(:class:`~router.config.IngressConfig`), the options supported, and parameters that contradict
each other. Every refusal is an :class:`~router.request.protocol.OpenAIError` (4xx) naming the field.

The checks that need the replicas' facts (the vocabulary, ``max_model_len``) or the prompt's
tokens come later, in :mod:`router.request.preparation`. The body's ``model`` (the served model or one of
its LoRA adapters, else 404) is resolved before these checks, by :mod:`router.lora.adapters`.
"""

# No "from __future__ import annotations", as in router/ingress.py.

import math
import re
from typing import Any

from replica.protocol.sampling_params import LOGIT_BIAS_LIMIT, MAX_LOGIT_BIAS_ENTRIES
from router.config import IngressConfig
from router.request.chat_flags import chat_flags
from router.request.protocol import ChatCompletionRequest, CompletionRequest, OpenAIError, _SamplingRequest

_TOKEN_ID_KEY = re.compile(r"-?[0-9]+")


def parse_logit_bias(raw: dict[str, Any] | None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` body (keys: token ids as strings) as ``{token id: bias}``; ``None``
    when absent or empty.

    Args:
        raw: the body's ``logit_bias``.
    Raises:
        OpenAIError: 400 ``invalid_value`` naming ``logit_bias``: more than
            ``MAX_LOGIT_BIAS_ENTRIES`` entries, a key that is not an integer, a negative id or one
            of more than 20 digits, or a value that is not a number in [-100, 100]. The vocabulary
            itself is a request rule (``replica.protocol.request_checks.check_vocabulary``).
    """
    if not raw:
        return None

    def refuse(message: str) -> OpenAIError:
        return OpenAIError(f"logit_bias: {message}", param="logit_bias", code="invalid_value")

    if len(raw) > MAX_LOGIT_BIAS_ENTRIES:
        raise refuse(f"at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(raw)}")
    parsed: dict[int, float] = {}
    for key, bias in raw.items():
        if not _TOKEN_ID_KEY.fullmatch(key):
            raise refuse(f"keys must be token ids (integers), got {key[:40]!r}")
        if key.startswith("-"):
            raise refuse(f"token id {key[:40]} is negative, outside the vocabulary")
        digits = key.lstrip("0") or "0"  # int() of the key itself fails past 4,300 digits, leading zeros too
        if len(digits) > 20:
            raise refuse(f"token id {key[:40]} is outside the vocabulary [0, vocab_size)")
        token_id = int(digits)
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or (isinstance(bias, float) and not math.isfinite(bias)):
            raise refuse(f"the bias of token {key} must be a number in [-100, 100], got {str(bias)[:40]!r}")
        if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
            raise refuse(f"the bias of token {key} must be in [-100, 100], got {str(bias)[:40]}")
        parsed[token_id] = float(bias)
    return parsed


class BodyChecks:
    """The checks of ``/v1/completions`` and ``/v1/chat/completions`` bodies.

    Args:
        config: the caps (``max_n``, ``max_logprobs``, stop sequences, prompts, choices).
    """

    def __init__(self, config: IngressConfig) -> None:
        self.config = config

    def check_completion(self, body: CompletionRequest) -> tuple[int, str]:
        """Check a ``/v1/completions`` body against the caps and the options supported.

        Returns:
            (choices, param): the replica requests it asks for (prompts x ``n``) and the field
            that names them in an error (``prompt`` for a list of prompts, else ``n``).
        Raises:
            OpenAIError: 400 naming the field.
        """
        self._check_common(body)
        if body.suffix:
            raise OpenAIError("suffix is not supported", param="suffix", code="unsupported")
        if body.best_of is not None and body.best_of < body.n:
            raise OpenAIError(f"best_of ({body.best_of}) must be at least n ({body.n})", param="best_of", code="invalid_value")
        if body.best_of is not None and body.best_of != body.n:
            raise OpenAIError("best_of other than n is not supported", param="best_of", code="unsupported")
        caps = self.config
        if len(body.prompt) > caps.max_prompts_per_request:
            raise OpenAIError(
                f"prompt: at most {caps.max_prompts_per_request} prompts per request, got {len(body.prompt)}",
                param="prompt", code="invalid_value",
            )
        fanout_param = "prompt" if len(body.prompt) > 1 else "n"
        self._check_fanout(len(body.prompt) * body.n, fanout_param)
        if body.logprobs is not None and body.logprobs > caps.max_logprobs:
            raise OpenAIError(f"logprobs: must be at most {caps.max_logprobs}, got {body.logprobs}", param="logprobs", code="invalid_value")
        return len(body.prompt) * body.n, fanout_param

    def check_chat(self, body: ChatCompletionRequest) -> tuple[int, str]:
        """Check a ``/v1/chat/completions`` body against the caps and the options supported.

        Returns:
            (choices, param): ``(n, "n")``, as :meth:`check_completion`.
        Raises:
            OpenAIError: 400 naming the field.
        """
        self._check_common(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise OpenAIError("top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
        if None not in (body.max_tokens, body.max_completion_tokens) and body.max_tokens != body.max_completion_tokens:
            raise OpenAIError(
                f"max_tokens ({body.max_tokens}) and max_completion_tokens ({body.max_completion_tokens}) disagree; "
                "send max_completion_tokens only (max_tokens is its deprecated name)",
                param="max_tokens", code="invalid_value",
            )
        chat_flags(body)  # vLLM's rules for add_generation_prompt, continue_final_message and echo
        if body.top_logprobs is not None and body.top_logprobs > self.config.max_logprobs:
            raise OpenAIError(
                f"top_logprobs: must be at most {self.config.max_logprobs}, got {body.top_logprobs}",
                param="top_logprobs", code="invalid_value",
            )
        self._check_fanout(body.n, "n")
        return body.n, "n"

    def _check_common(self, body: _SamplingRequest) -> None:
        if body.n > self.config.max_n:
            raise OpenAIError(f"n: must be at most {self.config.max_n}, got {body.n}", param="n", code="invalid_value")
        parse_logit_bias(body.logit_bias)  # the vocabulary is checked in _prepare
        if body.prompt_logprobs is not None and body.prompt_logprobs > self.config.max_logprobs:
            raise OpenAIError(
                f"prompt_logprobs: must be at most {self.config.max_logprobs}, got {body.prompt_logprobs}",
                param="prompt_logprobs", code="invalid_value",
            )
        if body.stream_options is not None and not body.stream:
            raise OpenAIError("stream_options is only allowed when stream is true", param="stream_options", code="invalid_value")
        stops = body.stop or []
        if len(stops) > self.config.max_stop_sequences:
            raise OpenAIError(
                f"stop: at most {self.config.max_stop_sequences} stop sequences, got {len(stops)}",
                param="stop", code="invalid_value",
            )
        longest = max((len(s) for s in stops), default=0)
        if longest > self.config.max_stop_sequence_length:
            raise OpenAIError(
                f"stop: a stop sequence has at most {self.config.max_stop_sequence_length} characters, got {longest}",
                param="stop", code="invalid_value",
            )

    def _check_fanout(self, choices: int, param: str) -> None:
        """Prompts × ``n`` (one replica request each) must not pass ``max_choices_per_request``."""
        if choices > self.config.max_choices_per_request:
            raise OpenAIError(
                f"{param}: the request asks for {choices} choices (prompts x n), at most "
                f"{self.config.max_choices_per_request} are allowed",
                param=param, code="invalid_value",
            )


def check_generates(info: dict[str, Any], model_name: str) -> None:
    """The replicas generate: an embedding model's (``info["embedding_only"]``, a pooling
    engine) serve ``/v1/embeddings`` alone. Raises a 400 naming ``model`` (the replica's own
    refusal, before a chat template or a tokenizer could fail first)."""
    if info.get("embedding_only"):
        raise OpenAIError(
            f"model: {model_name} is an embedding model: it serves /v1/embeddings only, not completions, chat or responses",
            param="model", code="model_not_supported",
        )
