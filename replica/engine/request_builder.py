"""Checking what a caller hands the engine and building the :class:`~replica.core.request.Request`.

Plain functions of the model's facts (tokenizer, vocabulary, ``max_model_len``, EOS ids), no
engine state, so any thread may call them (the async engine checks requests before queueing).
"""

from __future__ import annotations

import time
from typing import Any

from replica.core.request import Request
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
    """A checked :class:`Request`: text prompts are tokenized (with the tokenizer's special
    tokens); ``sampling_params`` default to vLLM's; ``arrival_time`` defaults to now (monotonic s).

    Raises:
        ValueError: naming the field: ``prompt`` empty or of the wrong type, a token id outside the
            vocabulary (prompt or ``logit_bias``), a prompt of ``max_model_len`` tokens or more
            (more only, with ``max_tokens=0``),
            bad ``sampling_params``, a ``structured_outputs`` constraint that does not compile
            (or any constraint when ``grammar_compiler`` is None).

    ``grammar_compiler`` (:class:`~replica.sample.grammar.GrammarCompiler`) compiles the
    constraint here, in the caller's thread: never on the engine loop.
    """
    params = sampling_params if sampling_params is not None else SamplingParams()
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
    params.validate()
    if params.logit_bias and max(params.logit_bias) >= vocab_size:
        raise ValueError(f"logit_bias holds token id {max(params.logit_bias)}, outside the vocabulary [0, {vocab_size})")
    if prompt_token_ids is None:
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        if not prompt:
            raise ValueError("prompt must not be empty")
        prompt_token_ids = tokenizer.encode(prompt, add_special_tokens=True)
    if not isinstance(prompt_token_ids, (list, tuple)) or not prompt_token_ids:
        raise ValueError("prompt_token_ids must be a non-empty list of token ids")
    prompt_token_ids = list(prompt_token_ids)
    for token_id in prompt_token_ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < vocab_size:
            raise ValueError(f"prompt_token_ids holds {token_id!r}, outside the vocabulary [0, {vocab_size})")
    room = max_model_len if params.max_tokens == 0 else max_model_len - 1  # scoring only needs no output slot
    if len(prompt_token_ids) > room:
        raise ValueError(
            f"prompt is {len(prompt_token_ids)} tokens; max_model_len is {max_model_len} "
            "(prompt + output tokens), so the prompt must be shorter"
        )
    grammar = None
    if params.structured_outputs is not None:
        if grammar_compiler is None:
            raise ValueError("structured_outputs: this engine has no grammar compiler")
        grammar = grammar_compiler.compile(params.structured_outputs)
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        sampling_params=params,
        eos_token_ids=eos_token_ids,
        arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
        grammar=grammar,
    )
