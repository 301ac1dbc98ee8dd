"""The settings the HTTP ingress reads (pydantic): served model name, API key, request caps, the
request body cap, the replicas' waiting bound, the shutdown grace period and how streamed tokens
travel from the replicas.

:class:`IngressConfig` holds them as flat fields; ``cluster.config.ServeConfig`` inherits it and
adds the engine (under ``engine:``) and the cluster settings, so a serve config file keeps one flat
shape. The ingress itself receives these fields alone (:meth:`IngressConfig.ingress_fields`), and
the engine settings it needs beside them (see :class:`router.ingress.OpenAIIngress`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator


class IngressConfig(BaseModel):
    """What the ingress (``router/``) reads: a request past one of the caps is refused with a 4xx
    naming the field."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    served_model_name: str | None = Field(
        None, min_length=1, description="The model id the API reports and accepts; default the engine's model."
    )
    api_key: str | None = Field(
        None,
        min_length=1,
        description="If set, every endpoint but /health needs 'Authorization: Bearer <api_key>'.",
    )
    max_waiting_requests: int = Field(
        256,
        ge=0,
        description=(
            "Requests one replica holds beyond its seats (max_num_seqs) at most. A request past "
            "max_num_seqs + max_waiting_requests is refused with 429 and Retry-After."
        ),
    )
    # ---- request caps: a request past one is refused with a 4xx naming the field ----
    max_n: int = Field(16, ge=1, description="Largest 'n' (choices per request) the API accepts.")
    max_logprobs: int = Field(
        20, ge=0, le=20, description="Largest 'logprobs' (completions) / 'top_logprobs' (chat) the API accepts."
    )
    max_stop_sequences: int = Field(16, ge=0, description="Stop strings per request at most.")
    max_stop_sequence_length: int = Field(256, ge=1, description="Characters per stop string at most.")
    max_prompts_per_request: int = Field(
        64, ge=1, description="Prompts in one /v1/completions request (a list of prompts) at most."
    )
    max_choices_per_request: int = Field(
        128, ge=1, description="Prompts x n of one request at most (each is one replica request)."
    )
    max_request_body_bytes: int = Field(
        8 * 2**20,
        ge=1024,
        description=(
            "Request body size at most (bytes); a larger body is refused with 413 before it is read "
            "whole (by Content-Length, or while a chunked body arrives)."
        ),
    )
    tool_call_parser: str = Field(
        "auto",
        description="The format tool calls are read from with tool_choice 'auto': 'hermes' (<tool_call> blocks), "
        "or 'auto' (the template's own).",
    )
    tool_chat_template: str | None = Field(
        None,
        description="A Jinja chat template file for chats with tools; default: the model's own if it renders "
        "tools, else Carpool's ChatML tool template for ChatML models.",
    )
    shutdown_timeout_s: float = Field(
        30.0,
        ge=0,
        description=(
            "On SIGTERM or Ctrl-C: seconds the requests in flight may take to finish (new ones get "
            "503 meanwhile) before the rest are ended with a 503 error and the server stops."
        ),
    )

    batched_deltas: bool = Field(
        True,
        description=(
            "Streamed requests get their tokens from each replica over one TCP connection per "
            "replica, one message per engine step for all of this ingress's requests there, instead "
            "of one Ray stream item per request per step (replica/serve/delta_channel.py). The replicas' "
            "nodes must accept connections from the ingress's on the port the OS gives them."
        ),
    )

    @field_validator("tool_call_parser")
    @classmethod
    def _check_parser(cls, value: str) -> str:
        from router.tool_templates import PARSER_NAMES

        if value not in PARSER_NAMES:
            raise ValueError(f"must be one of {', '.join(PARSER_NAMES)}")
        return value

    @field_validator("api_key")
    @classmethod
    def _check_api_key(cls, value: str | None) -> str | None:
        # HTTP headers carry latin-1 at best and clients send ASCII; the ingress compares the
        # stripped token, so a key with outer whitespace or other characters could never match.
        if value is not None and (not value.isascii() or not value.isprintable() or value != value.strip() or " " in value):
            raise ValueError("must be printable ASCII without spaces (it travels in an HTTP header)")
        return value

    def ingress_fields(self) -> dict[str, Any]:
        """The fields of :class:`IngressConfig` alone, as a dict (of a subclass such as
        ``ServeConfig`` too): what ``OpenAIIngress`` takes as its ``config``."""
        return self.model_dump(include=set(IngressConfig.model_fields))

    def served_name(self, engine_model: str) -> str:
        """The model id clients use in requests and see in ``/v1/models``: ``served_model_name``,
        else ``engine_model`` (the engine's ``model``)."""
        return self.served_model_name or engine_model
