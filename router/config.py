"""The settings the HTTP ingress reads (pydantic): served model name, API key, request caps, the
request body cap, the replicas' waiting bound, the shutdown grace period, how streamed tokens
travel from the replicas, and the LoRA adapters served (those known at start, and the directories
runtime loads may read from).

:class:`IngressConfig` holds them as flat fields; ``cluster.config.ServeConfig`` inherits it and
adds the engine (under ``engine:``) and the cluster settings, so a serve config file keeps one flat
shape. The ingress itself receives these fields alone (:meth:`IngressConfig.ingress_fields`), and
the engine settings it needs beside them (see :class:`router.ingress.OpenAIIngress`).
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

PARSER_NAMES = ("auto", "hermes")
"""``--tool-call-parser`` values: ``auto`` picks the format of the template in use (all render
``<tool_call>`` blocks so far: ``hermes``; :mod:`router.request.tool_templates`). Here, below the
request package, so that the settings import nothing of the layers above them."""


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

    # ---- LoRA adapters (docs/lora.md); the engine's own LoRA settings are EngineConfig's ----
    lora_modules: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "LoRA adapters served from the start, name -> folder of PEFT files (vLLM's --lora-modules "
            "name=path); clients name an adapter as the request's model. Each is checked at start. "
            "Relative folders are taken from the current directory."
        ),
    )
    lora_dirs: list[str] = Field(
        default_factory=list,
        description=(
            "Directories POST /v1/load_lora_adapter may load adapters from (symlinks and '..' "
            "resolved); a path anywhere else is refused with 400. Empty: runtime loads are refused."
        ),
    )

    # ---- the Responses API's store (docs/responses.md) ----
    response_store: str = Field(
        "serve",
        description=(
            "Where POST /v1/responses keeps stored responses: 'serve' (a ResponseStore deployment of the "
            "application, in memory, shared by every ingress replica), 'none' (nothing is stored), or "
            "'module:Class', an external store built as Class(**response_store_options)."
        ),
    )
    response_store_options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of an external response_store's class."
    )
    response_store_max_bytes: int = Field(
        256 * 2**20, ge=1024,
        description="Bytes of stored responses the 'serve' store holds at most; the least recently used go first.",
    )
    response_store_ttl_s: float = Field(
        30 * 86400.0, gt=0, description="Seconds a stored response is kept after it was made (OpenAI keeps them 30 days).",
    )

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _modules_as_mapping(cls, value: Any) -> Any:
        # A mapping, or a list (YAML's, or the command line's words) of vLLM's "name=path" strings
        # or {"name", "path"} objects.
        if isinstance(value, (list, tuple)):
            import json

            return dict(parse_lora_module(item if isinstance(item, str) else json.dumps(item)) for item in value)
        return value

    @field_validator("lora_modules")
    @classmethod
    def _check_modules(cls, value: dict[str, str]) -> dict[str, str]:
        for name, path in value.items():
            if not name.strip() or name != name.strip():
                raise ValueError(f"adapter name {name!r} must be non-empty, without outer spaces")
            if not path:
                raise ValueError(f"adapter {name!r} has an empty path")
        return {name: os.path.abspath(os.path.expanduser(path)) for name, path in value.items()}

    @field_validator("lora_dirs")
    @classmethod
    def _absolute_dirs(cls, value: list[str]) -> list[str]:
        if any(not d for d in value):
            raise ValueError("a directory is an empty string")
        return [os.path.abspath(os.path.expanduser(d)) for d in value]

    @field_validator("response_store")
    @classmethod
    def _check_store(cls, value: str) -> str:
        module, sep, name = value.partition(":")
        if value not in ("serve", "none") and not (sep and module and name.isidentifier()):
            raise ValueError("must be 'serve', 'none' or 'module:Class'")
        return value

    @field_validator("tool_call_parser")
    @classmethod
    def _check_parser(cls, value: str) -> str:
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


def parse_lora_module(text: str) -> tuple[str, str]:
    """One ``--lora-modules`` word as ``(name, path)``: vLLM's ``name=path``, or its JSON form
    ``{"name": ..., "path": ...}`` (other keys, such as ``base_model_name``, are ignored).

    Raises ``ValueError`` naming the word when it is neither, or a side is empty."""
    if text.lstrip().startswith("{"):
        import json

        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"a LoRA module in JSON is not valid JSON ({exc}): {text!r}") from None
        name, path = data.get("name"), data.get("path")
        if not isinstance(name, str) or not isinstance(path, str) or not name.strip() or not path.strip():
            raise ValueError(f'a LoRA module in JSON needs "name" and "path" strings, got {text!r}')
        return name.strip(), path.strip()
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"a LoRA module is name=path, got {text!r}")
    return name.strip(), path.strip()
