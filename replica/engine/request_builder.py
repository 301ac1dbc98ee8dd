"""Checking what a caller hands the engine and building the :class:`~replica.core.request.Request`.

Plain functions of the model's facts (tokenizer, vocabulary, ``max_model_len``, EOS ids), no
engine state, so any thread may call them (the async engine checks requests before queueing).
The rules are :mod:`replica.protocol.request_checks`' (the ingress's): a request from a caller
without an ingress passes all of them (:func:`build_request`); an envelope the ingress built, only
this engine's ``max_model_len`` (:func:`request_from_envelope`).
"""

from __future__ import annotations

import time
from typing import Any

from replica.core.request import Request
from replica.engine.lora_support import EngineLoRA, check_lora_request
from replica.protocol.envelope import RequestEnvelope
from replica.protocol.request_checks import ModelLimits, check_priority, check_prompt_fits, check_request
from replica.protocol.sampling_params import SamplingParams


def eos_token_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    """Every EOS id the model knows: its ``generation_config.eos_token_id`` (an id or a list)
    and the tokenizer's ``eos_token_id``, sorted."""
    ids: set[int] = set()
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def build_request(
    request_id: str,
    prompt: str | None,
    prompt_token_ids: list[int] | None,
    sampling_params: SamplingParams | None,
    arrival_time: float | None,
    *,
    tokenizer: Any,
    vocab_size: int,
    max_model_len: int,
    eos_token_ids: tuple[int, ...],
    grammar_compiler: Any = None,
) -> Request:
    """A checked :class:`Request` for a caller without an ingress (``LLM``, ``LLMEngine``): text
    prompts are tokenized (with the tokenizer's special tokens); ``sampling_params`` default to
    vLLM's (and are validated again: the caller's object is mutable); the request rules are the
    ingress's own (:func:`~replica.protocol.request_checks.check_request`, naming ``prompt`` or
    ``prompt_token_ids``); ``arrival_time`` defaults to now (monotonic s).

    Raises:
        ValueError: naming the field: ``prompt`` empty or of the wrong type, bad
            ``sampling_params``; :class:`~replica.protocol.errors.RequestError` (a ``ValueError``):
            an empty prompt, a token id outside the vocabulary (prompt, ``logit_bias``,
            ``stop_token_ids``), a prompt of ``max_model_len`` tokens or more (more only, when it
            scores the prompt only); what :func:`compile_grammar` raises.
    """
    params = sampling_params if sampling_params is not None else SamplingParams()
    if isinstance(params, SamplingParams):
        params.validate()
    param = "prompt_token_ids" if prompt_token_ids is not None else "prompt"
    if prompt_token_ids is None:
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        if not prompt:
            raise ValueError("prompt must not be empty")
        prompt_token_ids = tokenizer.encode(prompt, add_special_tokens=True)
    check_request(prompt_token_ids, params, ModelLimits(vocab_size, max_model_len), param=param)
    return _request(request_id, list(prompt_token_ids), params, arrival_time, eos_token_ids, grammar_compiler)


def request_from_envelope(
    envelope: RequestEnvelope,
    *,
    max_model_len: int,
    eos_token_ids: tuple[int, ...],
    grammar_compiler: Any = None,
    lora: EngineLoRA | None = None,
    scheduling_policy: str = "fcfs",
    check_pooling: Any = None,
) -> Request:
    """The :class:`Request` of an envelope the ingress built (and checked against the replicas'
    ``model_info``). Trusted: only what this engine alone knows is checked again: its adapters
    (the envelope's adapter is resolved here, once: read from its folder unless ``lora`` holds it
    in host memory) and its own ``max_model_len``
    (:func:`~replica.protocol.request_checks.check_prompt_fits`, the ingress's rule and message),
    and its ``priority`` against this engine's ``scheduling_policy``
    (:func:`~replica.protocol.request_checks.check_priority`); the constraint is compiled for this
    engine's tokenizer. Arrival: now. ``check_pooling(pooling_params)`` (the engine's
    ``check_pooling``) checks the envelope's pooling parameters (None: a generation request)
    against what this engine serves.

    Raises:
        replica.protocol.errors.LoRAAdapterError: the adapter cannot be used, or ``lora`` is None.
        replica.protocol.errors.RequestError: the prompt does not fit this engine's ``max_model_len``;
            a nonzero ``priority`` under ``"fcfs"``; what ``check_pooling`` raises.
        ValueError: what :func:`compile_grammar` raises.
    """
    priority = check_priority(envelope.priority, scheduling_policy)
    adapter = check_lora_request(lora, envelope.lora_request)
    params = envelope.sampling_params
    if check_pooling is not None:
        check_pooling(envelope.pooling_params)
    check_prompt_fits(len(envelope.prompt_token_ids), max_model_len, params.scores_prompt_only)
    request = _request(envelope.request_id, list(envelope.prompt_token_ids), params, None, eos_token_ids, grammar_compiler)
    request.pooling_params = envelope.pooling_params
    request.lora = adapter
    request.priority = priority
    request.slo = envelope.slo
    return request


def compile_grammar(params: SamplingParams, grammar_compiler: Any) -> Any:
    """The request's :class:`~replica.sample.grammar.Grammar` (None without ``structured_outputs``),
    compiled in the caller's thread: never on the engine loop.

    Raises:
        ValueError: the constraint does not compile for this tokenizer, or the engine has no
            ``grammar_compiler``.
    """
    if params.structured_outputs is None:
        return None
    if grammar_compiler is None:
        raise ValueError("structured_outputs: this engine has no grammar compiler")
    return grammar_compiler.compile(params.structured_outputs)


def _request(
    request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival_time: float | None,
    eos_token_ids: tuple[int, ...], grammar_compiler: Any,
) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        sampling_params=params,
        eos_token_ids=eos_token_ids,
        arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
        grammar=compile_grammar(params, grammar_compiler),
    )
