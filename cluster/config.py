"""The serving settings, with defaults and validation in one place (pydantic).

``ServeConfig`` composes the engine's own settings (:class:`replica.config.engine_config.EngineConfig`) with the
cluster and HTTP settings of ``carpool serve``.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import (
    ByteSize,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from cluster.autoscaling.settings import AutoscalingSettings
from replica.config.engine_config import DEFAULT_MODEL, EngineConfig
from replica.config.speculative_config import SpeculativeConfig
from router.config import IngressConfig

__all__ = [
    "DEFAULT_MODEL", "AutoscalingSettings", "EngineConfig", "ServeConfig", "format_validation_error", "parse_bytes",
    "parse_speculative_config",
]

_BYTE_SIZE = TypeAdapter(ByteSize)


def parse_bytes(text: str) -> int:
    """A size given on a command line, in bytes: ``"2GiB"`` → 2147483648, ``"500MB"`` → 500000000,
    ``"1.5 GiB"`` → 1610612736 (pydantic's ``ByteSize``: KB/MB/GB are powers of 10, KiB/MiB/GiB of 2).

    Raises ``ValueError`` for anything else.
    """
    try:
        return int(_BYTE_SIZE.validate_python(text))
    except ValidationError:
        raise ValueError(f"not a size: {text!r} (examples: 1073741824, 1GiB, 512MiB, 2GB)") from None


def format_validation_error(exc: ValidationError) -> str:
    """One line per bad field: ``engine.max_num_seqs: Input should be greater than or equal to 1 (got 0)``."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "config"
        msg = str(err["msg"]).removeprefix("Value error, ")
        given = err.get("input")
        shown = "" if isinstance(given, dict) or err["type"] in ("missing", "value_error") else f" (got {given!r})"
        lines.append(f"  {loc}: {msg}{shown}")
    return "\n".join(dict.fromkeys(lines))


def parse_speculative_config(text: str) -> dict[str, Any]:
    """The JSON object of ``--speculative-config`` (vLLM's flag), e.g.
    ``'{"method": "ngram", "num_speculative_tokens": 4}'``, as a dict; its keys are checked where
    it is used (``EngineConfig.speculative_config``).

    Raises ``ValueError`` when ``text`` is not JSON or not a JSON object.
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--speculative-config is not valid JSON ({exc}): {text!r}") from None
    if not isinstance(data, dict):
        raise ValueError(
            "--speculative-config must be a JSON object of speculative decoding settings "
            f"(keys: {', '.join(SpeculativeConfig.model_fields)}), got {type(data).__name__}: {text!r}"
        )
    return data


class ServeConfig(IngressConfig):
    """``carpool serve``: the engine settings of every replica plus the cluster and HTTP settings;
    the settings the ingress reads are inherited from :class:`~router.config.IngressConfig`.

    A config file (YAML or JSON) holds these fields, with the engine's under ``engine:``; command
    line options override it. Example::

        replicas: 2
        port: 8000
        engine:
          model: HuggingFaceTB/SmolLM2-135M-Instruct
          dtype: auto
          max_num_seqs: 64
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    engine: EngineConfig = Field(default_factory=EngineConfig, description="Each replica's engine settings.")
    replicas: int | Literal["auto"] = Field(
        "auto",
        description=(
            "Replica count, or auto: one per GPU in the Ray cluster when the device is CUDA, "
            "otherwise one per CPU core of the cluster."
        ),
    )
    host: str = Field("127.0.0.1", description="Address the HTTP server binds (0.0.0.0 for every interface).")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port of the OpenAI-compatible API.")
    address: str | None = Field(
        None, description="Ray cluster to join (e.g. 'auto' or 'ray://host:10001'); default a new local one."
    )
    app_name: str = Field("carpool", min_length=1, description="Serve application name.")
    num_cpus_per_replica: float = Field(
        1.0, gt=0, description="CPUs Ray reserves for each replica; on CPU, also its torch thread count."
    )
    max_ongoing_requests: int = Field(
        1024,
        ge=1,
        description=(
            "Serve's cap of requests in flight to one replica. It must be above what a replica "
            "admits (max_num_seqs + max_waiting_requests), so that requests reach the replica, which "
            "refuses the ones past its waiting bound (429) instead of Serve queueing them."
        ),
    )
    ingress_replicas: int = Field(1, ge=1, description="Replicas of the HTTP ingress (tokenization, SSE).")
    direct_ingress: bool = Field(
        True,
        description=(
            "When this command starts its own local Ray cluster and runs one ingress replica, that "
            "replica serves HTTP on host:port itself (Ray Serve's direct ingress), without the hop "
            "through Serve's HTTP proxy, which then listens on a free port of its own. Joined "
            "clusters and several ingress replicas keep the proxy on host:port."
        ),
    )
    routing_stats_period_s: float = Field(
        0.5, gt=0, description="How often Serve polls each replica's routing stats (seconds)."
    )
    prefix_aware_routing: bool = Field(
        True,
        description=(
            "Cache-aware routing: among replicas with a free seat, send a prompt to the one this "
            "router sent the longest matching prefix to (its KV blocks are likely still cached "
            "there), within a load-imbalance bound; False routes on load alone."
        ),
    )
    lora_aware_routing: bool = Field(
        True,
        description=(
            "Adapter-aware routing: among replicas with a free seat, send a LoRA request to one that "
            "holds its adapter in a device slot, within the same load-imbalance bound; False ignores "
            "adapters when routing."
        ),
    )
    include_dashboard: bool = Field(False, description="Start Ray's dashboard with a new local cluster.")
    autoscaling: AutoscalingSettings | None = Field(
        None,
        description=(
            "Autoscale the replicas between min_replicas and max_replicas (by default on seats, queue "
            "wait and KV use: cluster/autoscaling/) instead of a fixed count; replicas must then stay 'auto'."
        ),
    )

    @field_validator("replicas", mode="before")
    @classmethod
    def _check_replicas(cls, value: object) -> int | str:
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return value
        raise ValueError(f"must be a positive integer or 'auto', got {value!r}")

    @model_validator(mode="after")
    def _check_scaling(self) -> "ServeConfig":
        # Serve rejects a deployment with both num_replicas and autoscaling_config.
        if self.autoscaling is not None and self.replicas != "auto":
            raise ValueError(
                f"replicas={self.replicas} and autoscaling are both set: give a fixed replica count "
                "or autoscaling bounds, not both"
            )
        return self

    @model_validator(mode="after")
    def _check_max_ongoing(self) -> "ServeConfig":
        admitted = self.engine.max_num_seqs + self.max_waiting_requests
        if self.max_ongoing_requests <= admitted:
            raise ValueError(
                f"max_ongoing_requests ({self.max_ongoing_requests}) must be greater than "
                f"engine.max_num_seqs + max_waiting_requests ({admitted}); otherwise Serve queues the "
                "requests a replica would refuse"
            )
        return self

    @model_validator(mode="after")
    def _check_lora(self) -> "ServeConfig":
        # Adapters given (lora_modules, lora_dirs) turn LoRA on, unless engine.enable_lora is false
        # on purpose: then they are refused rather than silently ignored.
        wants = self.lora_modules or self.lora_dirs
        if wants and not self.engine.enable_lora:
            if "enable_lora" in self.engine.model_fields_set:
                given = "lora_modules" if self.lora_modules else "lora_dirs"
                raise ValueError(f"{given} needs LoRA, but engine.enable_lora is false")
            self.engine.enable_lora = True
        if self.model_name in self.lora_modules:
            raise ValueError(f"lora_modules: adapter name {self.model_name!r} is the served model's name")
        return self

    @property
    def model_name(self) -> str:
        """The model id clients use in requests and see in ``/v1/models``."""
        return self.served_name(self.engine.model)
