"""A request's sampling parameters (vLLM's ``SamplingParams``: names, defaults and checks)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from replica.protocol.constraints import StructuredOutputsParams

# Most entries a ``logit_bias`` may hold (OpenAI documents no cap; this bounds the work per request).
MAX_LOGIT_BIAS_ENTRIES = 1024
# Output tokens of a request that does not say (vLLM's and OpenAI's completions default).
DEFAULT_MAX_TOKENS = 16
# Range of a ``logit_bias`` value (OpenAI's): -100 effectively bans the token, 100 forces it.
LOGIT_BIAS_LIMIT = 100.0


def scores_prompt_only(max_tokens: int | None) -> bool:
    """Whether a request of ``max_tokens`` output tokens only scores its prompt: 0 generates
    nothing; the prompt is prefilled, its ``prompt_logprobs`` computed, and the request ends with
    ``length`` (None: the default, which generates). What :attr:`SamplingParams.scores_prompt_only`
    says of built parameters, for a body whose parameters are not built yet."""
    return max_tokens == 0


@dataclass
class SamplingParams:
    """Per-request sampling parameters (vLLM's names and defaults).

    Validation happens at construction: a bad value raises ``ValueError`` whose message starts
    with the field name, e.g. ``"top_p must be in (0, 1], got 1.5"``.

    Attributes:
        n: sequences to generate for the prompt (``LLM.generate`` and the API fan them out
            into ``n`` engine requests; a seeded request's i-th sequence uses ``seed + i``).
        max_tokens: most output tokens to generate (tokens, >= 0; 0 scores the prompt only: it is
            prefilled, its ``prompt_logprobs`` computed, and the request ends with ``length``).
        min_tokens: EOS and ``stop_token_ids`` are masked until this many tokens exist.
        temperature: 0 means greedy; otherwise logits are divided by it (>= 0).
        top_k: keep the k most likely tokens; 0 or -1 disables.
        top_p: nucleus sampling mass in (0, 1] (Holtzman et al. 2019, arXiv:1904.09751).
        min_p: drop tokens whose probability is below ``min_p * p_max``, in [0, 1].
        presence_penalty / frequency_penalty: OpenAI's additive penalties in [-2, 2], over the
            request's own output tokens only.
        repetition_penalty: CTRL's multiplicative penalty (Keskar et al. 2019, arXiv:1909.05858)
            over the request's prompt and output tokens, > 0 (1 disables).
        seed: a private generator per request, so samples never depend on batch mates.
        stop: strings that end generation; matched across token boundaries on the text.
        stop_token_ids: token ids that end generation (kept in ``token_ids``).
        ignore_eos: keep generating past EOS (benchmarks).
        logprobs: if set, return the sampled token's logprob and this many top alternatives.
        prompt_logprobs: if set, return each prompt token's logprob given the tokens before it
            (the first prompt token has none) and this many top alternatives, in [0, 20]. Only
            requests that set it pay for the extra logits rows.
        include_stop_str_in_output: keep the matched stop string in the text.
        skip_special_tokens: drop special tokens (e.g. EOS) from the text.
        logit_bias: ``{token id: bias}`` added to the raw logits before anything else (penalties,
            min_tokens, temperature); OpenAI's: biases in [-100, 100] (-100 effectively bans the
            token, 100 forces it), at most ``MAX_LOGIT_BIAS_ENTRIES`` entries. Logprobs stay
            those of the unbiased logits (as vLLM reports them). The engine also refuses ids
            outside the model's vocabulary.
        structured_outputs: a constraint on the output (a JSON schema, any JSON object, a regex,
            a choice, a Lark grammar; :class:`~replica.protocol.constraints.StructuredOutputsParams`
            or a dict of its fields), enforced while decoding. The request ends (``stop``) as
            soon as the constraint is complete, even before ``min_tokens``.
    """

    n: int = 1
    max_tokens: int = DEFAULT_MAX_TOKENS
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    MAX_LOGPROBS = 20

    def __post_init__(self) -> None:
        self.validate()

    @property
    def scores_prompt_only(self) -> bool:
        """The request only scores its prompt (``max_tokens`` 0): its prefill ends it, nothing is
        sampled, and a prompt of ``max_model_len`` tokens fits (:func:`scores_prompt_only`)."""
        return scores_prompt_only(self.max_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Check every field; raise ``ValueError`` naming the first bad one."""

        def number(name: str, value: Any, *, integer: bool = False) -> None:
            kinds = (int,) if integer else (int, float)
            if isinstance(value, bool) or not isinstance(value, kinds):
                kind = "an integer" if integer else "a number"
                raise ValueError(f"{name} must be {kind}, got {value!r}")
            if not integer and not math.isfinite(value):
                raise ValueError(f"{name} must be finite, got {value!r}")

        number("n", self.n, integer=True)
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        number("max_tokens", self.max_tokens, integer=True)
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be at least 0, got {self.max_tokens}")
        number("min_tokens", self.min_tokens, integer=True)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        number("top_k", self.top_k, integer=True)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k}")
        number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            number(name, value)
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.seed is not None:
            number("seed", self.seed, integer=True)
            # torch.Generator.manual_seed takes 64-bit seeds; sequence i of n uses seed + i.
            if not -(2**63) <= self.seed <= 2**63 - self.n:
                raise ValueError(f"seed must be a 64-bit signed integer (with seed + n - 1 in range), got {self.seed}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {type(self.stop).__name__}")
        for s in self.stop:
            if not isinstance(s, str):
                raise ValueError(f"stop must contain only strings, got {s!r}")
            if s == "":
                raise ValueError("stop must not contain an empty string")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must contain non-negative integers, got {t!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                number(name, value, integer=True)
                if not 0 <= value <= self.MAX_LOGPROBS:
                    raise ValueError(f"{name} must be in [0, {self.MAX_LOGPROBS}], got {value}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id to bias, got {type(self.logit_bias).__name__}")
            if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
                raise ValueError(
                    f"logit_bias holds at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(self.logit_bias)}"
                )
            for token_id, bias in self.logit_bias.items():
                if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                    raise ValueError(f"logit_bias keys must be non-negative integer token ids, got {token_id!r}")
                if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
                    raise ValueError(f"logit_bias values must be finite numbers, got {bias!r} for token {token_id}")
                if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {token_id}")
            self.logit_bias = {token_id: float(bias) for token_id, bias in self.logit_bias.items()}
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as exc:
                raise ValueError(f"structured_outputs: {exc}") from None
        elif self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError(
                    f"structured_outputs must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}"
                )
            self.structured_outputs.validate()
