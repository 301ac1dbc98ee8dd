"""The ``POST /v1/responses`` body (pydantic), as OpenAI's Responses API defines it for text.

Accepted: ``model``, ``input`` (a string, or a list of items: messages, ``function_call``,
``function_call_output``; :mod:`router.responses.items` reads them), ``instructions``,
``max_output_tokens``, ``temperature``, ``top_p``, ``text.format``, ``tools`` (functions),
``tool_choice``, ``parallel_tool_calls``, ``stream``, ``store``, ``previous_response_id``,
``metadata``, ``user``, ``truncation: disabled``; vLLM's sampling extras ``seed``, ``top_k``,
``min_p``, ``repetition_penalty``. Fields for what Carpool does not do (``background: true``,
``truncation: auto``, ``conversation``, ``prompt``, ``top_logprobs``, ``reasoning`` settings)
are refused with a 400 naming them (:func:`check_supported`); other unknown fields are ignored,
as in the other bodies (:mod:`router.request.protocol`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator

from router.request.protocol import MAX_TOKEN_COUNT, Number, OpenAIError


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = Field(None, description="Model id; default the served model.")
    input: Any = Field(..., description="A string (one user message) or a list of input items.")
    instructions: StrictStr | None = Field(None, description="A system message put first; not carried over to follow-ups.")
    max_output_tokens: StrictInt | None = Field(None, ge=1, le=MAX_TOKEN_COUNT)
    temperature: Number | None = Field(None, ge=0, le=2)
    top_p: Number | None = Field(None, gt=0, le=1)
    text: dict[str, Any] | None = Field(None, description="{'format': {'type': 'text' | 'json_object' | 'json_schema', ...}}.")
    tools: list[dict[str, Any]] | None = Field(None, description="Functions: [{'type': 'function', 'name', 'description', 'parameters'}].")
    tool_choice: Any = Field(None, description="'none', 'auto', 'required', or {'type': 'function', 'name': ...}.")
    parallel_tool_calls: StrictBool = True
    stream: StrictBool = False
    store: StrictBool = Field(True, description="Keep the response for GET and for follow-ups (previous_response_id).")
    previous_response_id: StrictStr | None = Field(None, description="Continue the conversation of a stored response.")
    background: StrictBool | None = Field(None, description="Not supported: true is refused.")
    metadata: dict[StrictStr, StrictStr] | None = Field(None, max_length=16)
    user: StrictStr | None = None
    truncation: Literal["disabled", "auto"] | None = None
    # Fields of features Carpool does not have: refused when set (check_supported).
    conversation: Any = None
    prompt: Any = None
    top_logprobs: Any = None
    reasoning: Any = None
    # vLLM's sampling extras.
    seed: StrictInt | None = None
    top_k: StrictInt | None = Field(None, ge=-1)
    min_p: Number | None = Field(None, ge=0, le=1)
    repetition_penalty: Number | None = Field(None, gt=0)

    @field_validator("input")
    @classmethod
    def _text_or_items(cls, value: Any) -> str | list[Any]:
        # One check of the field's type (a union type would name its member, "input.str"); each
        # item's shape is read by router.responses.items, which names "input.<i>".
        if not isinstance(value, (str, list)):
            raise ValueError("must be a string or a list of input items")
        if isinstance(value, list) and not value:
            raise ValueError("must not be empty")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_sizes(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        for key, item in (value or {}).items():
            if len(key) > 64 or len(item) > 512:
                raise ValueError("keys have at most 64 characters and values at most 512")
        return value


def unsupported(param: str, message: str) -> OpenAIError:
    """A 400 ``unsupported_parameter`` naming ``param``."""
    return OpenAIError(f"{param}: {message}", param=param, code="unsupported_parameter")


def check_supported(body: ResponsesRequest) -> None:
    """Refuse, with a 400 naming the field, what Carpool's Responses API does not do.

    Raises:
        OpenAIError: ``background: true`` (responses run while their request is open; no
            background queue), ``truncation: auto`` (a conversation is never cut: one past
            ``max_model_len`` gets 400 ``context_length_exceeded``), ``conversation``,
            ``prompt`` (stored prompts), ``top_logprobs``, ``reasoning`` with settings.
    """
    if body.background:
        raise unsupported("background", "background responses are not supported; send the request without it (or false)")
    if body.truncation == "auto":
        raise unsupported("truncation", "only 'disabled' is supported: a conversation longer than the context is refused")
    for name in ("conversation", "prompt", "top_logprobs"):
        if getattr(body, name) is not None:
            raise unsupported(name, "not supported by this server")
    reasoning = body.reasoning
    if reasoning is not None and not (isinstance(reasoning, dict) and all(v is None for v in reasoning.values())):
        raise unsupported("reasoning", "this model has no reasoning settings")
