"""The one set of request rules that depend on the model: token ids inside the vocabulary (the
prompt, ``logit_bias``, ``stop_token_ids``) and a prompt that fits ``max_model_len``.

Torch-free, so that every place a request is built calls these same functions: the ingress
(``router/request/preparation.py``, before it plans the choices it sends as envelopes:
:mod:`replica.protocol.envelope`) and the
offline engine (``replica/engine/request_builder.py``, which has no ingress). A replica trusts an
envelope the ingress built and re-checks only :func:`check_prompt_fits` against its own
``max_model_len``. Every refusal is a :class:`~replica.protocol.errors.RequestError` (a
``ValueError``) whose message starts with the field at fault.

The field-by-field rules of the sampling parameters themselves are ``SamplingParams.validate``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from replica.protocol.errors import RequestError
from replica.protocol.sampling_params import SamplingParams


@dataclass(frozen=True)
class ModelLimits:
    """What a request is checked against: ``vocab_size`` (token ids are in ``[0, vocab_size)``)
    and ``max_model_len`` (tokens of prompt plus output, at most)."""

    vocab_size: int
    max_model_len: int


def check_token_ids(param: str, token_ids: Iterable[Any], vocab_size: int) -> None:
    """Every id an integer in ``[0, vocab_size)``.

    Raises:
        RequestError: ``"<param>: token id <t> is outside the vocabulary [0, <vocab_size>)"``.
    """
    for t in token_ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise RequestError(f"{param}: token id {t!r} is outside the vocabulary [0, {vocab_size})", param)


def check_prompt_fits(num_tokens: int, max_model_len: int, scores_prompt_only: bool, param: str = "prompt") -> None:
    """A prompt of ``num_tokens`` tokens leaves room for output: shorter than ``max_model_len``,
    or at most that long when the request only scores it (``scores_prompt_only``:
    ``SamplingParams.scores_prompt_only``, or :func:`~replica.protocol.sampling_params.scores_prompt_only`
    of a body's ``max_tokens`` before its parameters exist).

    Raises:
        RequestError: ``context_length_exceeded``, naming ``param``.
    """
    if num_tokens > max_model_len or (num_tokens == max_model_len and not scores_prompt_only):
        # a prompt only scored (or embedded) generates nothing: it is too long, not short of room
        why = "more than that" if scores_prompt_only else "which leaves no room for output"
        raise RequestError(
            f"{param}: this model's maximum context length is {max_model_len} tokens; the prompt "
            f"has {num_tokens} tokens, {why}. Please shorten it.",
            param, "context_length_exceeded",
        )


def check_vocabulary(logit_bias: dict[int, float] | None, stop_token_ids: Iterable[int] | None, vocab_size: int) -> None:
    """The token ids of the sampling parameters (``logit_bias`` keys, ``stop_token_ids``) are
    inside the vocabulary.

    Raises:
        RequestError: naming ``logit_bias`` or ``stop_token_ids``.
    """
    check_token_ids("logit_bias", logit_bias or (), vocab_size)
    check_token_ids("stop_token_ids", stop_token_ids or (), vocab_size)


def check_request(
    prompt_token_ids: Sequence[int], params: SamplingParams, limits: ModelLimits, param: str = "prompt"
) -> None:
    """Every model-dependent rule of one request: a non-empty prompt of ids inside the
    vocabulary that fits ``max_model_len``, and sampling parameters whose token ids are inside
    the vocabulary. ``param`` is the field that holds the prompt (named in errors).

    Raises:
        RequestError: the first rule broken (``params`` not a ``SamplingParams``, an empty
            prompt, a token id outside the vocabulary, a prompt too long).
    """
    if not isinstance(params, SamplingParams):
        raise RequestError(f"sampling_params must be a SamplingParams, got {type(params).__name__}", "sampling_params")
    if not isinstance(prompt_token_ids, (list, tuple)) or not prompt_token_ids:
        raise RequestError(f"{param} must be a non-empty list of token ids", param)
    check_vocabulary(params.logit_bias, params.stop_token_ids, limits.vocab_size)
    check_token_ids(param, prompt_token_ids, limits.vocab_size)
    check_prompt_fits(len(prompt_token_ids), limits.max_model_len, params.scores_prompt_only, param)


MAX_PRIORITY = 2**63 - 1
"""``priority`` is an int in ``[-MAX_PRIORITY, MAX_PRIORITY]`` (an int64, as vLLM's protobuf-free
API leaves it unbounded; a bound keeps keys and messages small)."""


def check_priority(priority: Any, scheduling_policy: str, param: str = "priority") -> int:
    """A request's ``priority`` (vLLM's: lower runs first, 0 by default) for an engine that orders
    its queue by ``scheduling_policy``: an int (not a bool) within :data:`MAX_PRIORITY`, and 0
    unless the policy is ``"priority"`` (vLLM refuses the same: "Got priority ... but Priority
    scheduling is not enabled"). Returns it.

    Raises:
        RequestError: ``invalid_value``, naming ``param``.
    """
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise RequestError(f"{param} must be an integer, got {type(priority).__name__}", param)
    if not -MAX_PRIORITY <= priority <= MAX_PRIORITY:
        raise RequestError(f"{param} must be within [-{MAX_PRIORITY}, {MAX_PRIORITY}], got {priority}", param)
    if priority != 0 and scheduling_policy != "priority":
        raise RequestError(
            f"{param} {priority} is only applicable when the scheduling policy is 'priority' (this server's is "
            f"{scheduling_policy!r}: serve with --scheduling-policy priority, or send priority 0)", param,
        )
    return priority
