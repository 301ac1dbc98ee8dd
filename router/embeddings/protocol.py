"""The body of ``POST /v1/embeddings`` (OpenAI's embeddings API, pydantic): what it accepts and
how ``input`` is normalized. A body that breaks a rule here is a 400 naming the field
(:mod:`router.request.errors` answers pydantic's errors)."""

# No "from __future__ import annotations", as in router/ingress.py.

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator

MAX_INPUTS = 2048
"""OpenAI's limit on the inputs of one embeddings request (clients such as LangChain send batches
of up to 1000)."""


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


class EmbeddingRequest(BaseModel):
    """``POST /v1/embeddings``: OpenAI's fields (``input``, ``model``, ``encoding_format``,
    ``dimensions``, ``user``) and vLLM's ``priority`` (as in completions); others are ignored, as
    in the other endpoints' bodies.

    ``input`` is a string, a list of strings, a list of token ids, or a list of token id lists
    (OpenAI's four forms), normalized to a list of inputs, each a string or a list of ids. An empty
    list, an empty string or an empty id list is refused (OpenAI refuses them too).
    """

    model_config = ConfigDict(extra="ignore")

    input: Any = Field(..., description="A string, a list of strings, a list of token ids, or a list of token id lists.")
    model: StrictStr | None = Field(None, description="Model id; default the served model.")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="float: lists of numbers; base64: each vector's little-endian float32 bytes, base64-encoded."
    )
    dimensions: StrictInt | None = Field(
        None, ge=1, description="Keep the first this many components (Matryoshka models only; else 400)."
    )
    user: StrictStr | None = Field(None, description="Accepted and ignored.")
    priority: StrictInt = Field(
        0,
        description="vLLM's extra: lower runs first (0 by default); not 0 only when the server's scheduling policy is 'priority'.",
    )

    @field_validator("input")
    @classmethod
    def _check_input(cls, value: Any) -> list[str | list[int]]:
        """Normalize to a list of inputs, each a non-empty string or a non-empty list of token ids."""
        if isinstance(value, str):
            inputs = [value]
        elif _is_ids(value) and value:
            inputs = [value]
        elif isinstance(value, list) and not value:
            raise ValueError("must not be empty")
        elif isinstance(value, list) and all(isinstance(p, str) or _is_ids(p) for p in value):
            inputs = list(value)
        else:
            raise ValueError("must be a string, a list of strings, a list of token ids, or a list of token id lists")
        if len(inputs) > MAX_INPUTS:
            raise ValueError(f"must hold at most {MAX_INPUTS} inputs, got {len(inputs)}")
        for i, p in enumerate(inputs):
            if len(p) == 0:
                raise ValueError(f"must not contain an empty {'string' if isinstance(p, str) else 'token list'} (input {i})")
        return inputs
