"""OpenAI request bodies (pydantic) and the OpenAI error shape.

Field names, defaults and ranges follow the OpenAI API; the extras vLLM users expect (``top_k``,
``min_p``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``, ``min_tokens``,
``skip_special_tokens``, ``include_stop_str_in_output``, ``priority``) are accepted too. Unknown fields are
ignored (as vLLM does), so newer clients keep working.

Types are strict where a silent conversion would hide a client bug: an integer field rejects
``"5"``, ``5.5`` and ``true``; a number field takes integers and floats only; a boolean field
takes only ``true``/``false``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator


def _number(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"must be a number, got {type(value).__name__}")
    return value


Number = Annotated[float, BeforeValidator(_number), Field(allow_inf_nan=False)]
"""A finite JSON number (int or float); strings and booleans are rejected."""

MAX_LOGPROBS = 20  # the engine's cap (SamplingParams.MAX_LOGPROBS); the server's may be lower
MAX_PRIORITY = 2**63 - 1  # replica.protocol.request_checks.MAX_PRIORITY: an int64
MAX_TOKEN_COUNT = 2**63 - 1  # token counts (max_tokens, min_tokens) fit an int64: arithmetic and messages stay small
# The server's own caps (n, stop sequences, prompts, logprobs) are IngressConfig fields
# (router/config.py), checked by the ingress (router/request/preparation.py).


DEFAULT_CODES = {
    400: "invalid_request",
    401: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    415: "unsupported_media_type",
    429: "overloaded",
    500: "internal_error",
    503: "unavailable",
}
"""The ``code`` of an :class:`OpenAIError` raised without one, by HTTP status."""


class OpenAIError(Exception):
    """An error the API answers with ``{"error": {"message", "type", "param", "code"}}``.

    Args:
        message: what went wrong, naming the field when one is at fault.
        status_code: HTTP status (4xx for the client's mistakes, 503 when no replica can serve).
        type: OpenAI's error type, e.g. ``invalid_request_error``.
        param: the offending request field (dotted path), if any.
        code: a machine-readable code, e.g. ``model_not_found``; default the status's own
            (:data:`DEFAULT_CODES`), so that no error body has a null ``code``.
        retry_after_s: the ``Retry-After`` of a 429 or 503 (seconds); None: the default
            (``router.request.errors.RETRY_AFTER_S``).
        should_retry: False sends ``x-should-retry: false``, which tells the ``openai`` clients
            not to retry (a request that asked to be refused rather than served late).
    """

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
        should_retry: bool = True,
    ) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.should_retry = should_retry
        self.message = message
        self.status_code = status_code
        self.type = type
        self.param = param
        self.code = code or DEFAULT_CODES.get(status_code, "invalid_request" if status_code < 500 else "internal_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool = Field(False, description="Send a last chunk with the request's usage.")


def _check_stop(value: Any) -> list[str] | None:
    if value is None:
        return None
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ValueError("must be a string or a list of strings")
    if any(s == "" for s in stops):
        raise ValueError("stop sequences must not be empty strings")
    return stops


class _SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = Field(None, description="Model id; default the served model.")
    n: StrictInt = Field(1, ge=1, description="Choices to generate (the server caps it with max_n).")
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    temperature: Number | None = Field(None, ge=0, le=2, description="0 = greedy; default 1.")
    top_p: Number | None = Field(None, gt=0, le=1)
    presence_penalty: Number | None = Field(None, ge=-2, le=2)
    frequency_penalty: Number | None = Field(None, ge=-2, le=2)
    seed: StrictInt | None = Field(None, description="Choice i of a seeded request uses seed + i.")
    stop: Any = Field(None, description="A string or a list of strings that end generation (max_stop_sequences).")
    user: StrictStr | None = None
    logit_bias: dict[str, Any] | None = Field(
        None,
        description="Token id (a string of an integer) to a bias in [-100, 100] added to the logits before "
        "sampling (-100 bans the token, 100 forces it); at most 1024 entries. Logprobs stay unbiased.",
    )
    # vLLM extras
    top_k: StrictInt | None = Field(None, ge=-1, description="-1 or 0 disables.")
    min_p: Number | None = Field(None, ge=0, le=1)
    repetition_penalty: Number | None = Field(None, gt=0)
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = Field(None, max_length=256)
    min_tokens: StrictInt = Field(0, ge=0, le=MAX_TOKEN_COUNT)
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    prompt_logprobs: StrictInt | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="Each prompt token's logprob and this many top alternatives (vLLM's extra)."
    )
    priority: StrictInt = Field(
        0, ge=-MAX_PRIORITY, le=MAX_PRIORITY,
        description="vLLM's extra: lower runs first (0 by default); not 0 only when the server's scheduling policy is 'priority'.",
    )
    # Structured output (router/request/structured.py): OpenAI's response_format, vLLM's extras.
    response_format: Any = Field(
        None, description="{'type': 'text'}, {'type': 'json_object'} or {'type': 'json_schema', 'json_schema': {'name', 'schema', 'strict'}}.",
    )
    structured_outputs: Any = Field(
        None, description="vLLM's extra: exactly one of json (a schema), json_object, regex, choice, grammar (Lark).",
    )
    guided_json: Any = Field(None, description="vLLM's older name of structured_outputs.json.")
    guided_regex: Any = Field(None, description="vLLM's older name of structured_outputs.regex.")
    guided_choice: Any = Field(None, description="vLLM's older name of structured_outputs.choice.")
    guided_grammar: Any = Field(None, description="vLLM's older name of structured_outputs.grammar.")

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: Any) -> list[str] | None:
        return _check_stop(value)

    @field_validator("stop_token_ids")
    @classmethod
    def _non_negative_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(t < 0 for t in value):
            raise ValueError("token ids must be non-negative")
        return value


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``."""

    prompt: Any = Field(..., description="A string, a list of strings, a list of token ids, or a list of such lists.")
    max_tokens: StrictInt | None = Field(
        None, ge=0, le=MAX_TOKEN_COUNT, description="Output tokens at most; omitted: 16 (at least min_tokens), capped at what the context leaves; "
        "0 with echo scores the prompt only.",
    )
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: StrictStr | None = Field(None, description="Not supported.")
    best_of: StrictInt | None = Field(None, ge=1, description="Only best_of == n is supported.")

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: Any) -> list[str | list[int]]:
        """Normalize to a list of prompts, each a string or a list of token ids."""

        def is_ids(x: Any) -> bool:
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if isinstance(value, str):
            prompts = [value]
        elif is_ids(value) and value:
            prompts = [value]
        elif isinstance(value, list) and value and all(isinstance(p, str) or is_ids(p) for p in value):
            prompts = list(value)
        elif isinstance(value, list) and not value:
            raise ValueError("must not be empty")
        else:
            raise ValueError("must be a string, a list of strings, a list of token ids, or a list of token id lists")
        for p in prompts:
            if len(p) == 0:
                raise ValueError("must not contain an empty prompt")
        return prompts


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, tool_call_id ... reach the template

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None

    @field_validator("content")
    @classmethod
    def _check_content(cls, value: Any) -> str | None:
        """A string, null, or a list of text parts (joined); other part types are rejected."""
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list):
            texts = []
            for i, part in enumerate(value):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ValueError(f"part {i} is {kind!r}; only text parts ({{'type': 'text', 'text': ...}}) are supported")
                texts.append(part["text"])
            return "".join(texts)
        raise ValueError("must be a string, null, or a list of text parts")


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1, le=MAX_TOKEN_COUNT, description="Deprecated name of max_completion_tokens.")
    max_completion_tokens: StrictInt | None = Field(None, ge=1, le=MAX_TOKEN_COUNT, description="Output tokens at most; default: up to max_model_len.")
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    echo: StrictBool = Field(
        False, description="vLLM's extra: the reply starts with the last message's content when that message has the reply's role.",
    )
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Any = Field(None, description="Functions the model may call: [{'type': 'function', 'function': {'name', 'description', 'parameters'}}].")
    tool_choice: Any = Field(
        None, description="'none', 'auto' (default with tools), 'required', or {'type': 'function', 'function': {'name': ...}}.",
    )
    parallel_tool_calls: StrictBool = Field(True, description="False: at most one tool call per reply.")


class LoadLoRAAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's body): serve the adapter in ``lora_path`` as the model
    ``lora_name``. vLLM's other fields (``lora_int_id``, ``load_inplace``) are ignored."""

    model_config = ConfigDict(extra="ignore")

    lora_name: StrictStr = Field(..., min_length=1, max_length=256, description="The model id clients will send.")
    lora_path: StrictStr = Field(..., min_length=1, max_length=4096, description="The adapter's folder on the replicas' nodes.")


class UnloadLoRAAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's body): stop serving the adapter ``lora_name``."""

    model_config = ConfigDict(extra="ignore")

    lora_name: StrictStr = Field(..., min_length=1, max_length=256, description="The adapter's model id.")
