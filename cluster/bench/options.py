"""The options of ``carpool bench ...`` that are no field of the serving settings, one pydantic model
per command, from shared field types (``JsonPath``, ``Threads``, the seed mix's and multi-turn's
options...). ``cluster/bench/cli.py`` generates each command's options from its model's fields and
from the engine's and the server's own fields (``EngineConfig``, ``ServeConfig``); see
``cluster/settings_cli.py``. Plain data: importing this module imports no torch.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, List, Literal, Optional

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from cluster.settings_cli import flag


def _comma_ints(value: object) -> object:
    if isinstance(value, str):
        try:
            return [int(part) for part in value.split(",") if part.strip()]
        except ValueError:
            raise ValueError(f"must be comma-separated integers, got {value!r}") from None
    return value


def _comma_words(value: object) -> object:
    return [part.strip() for part in value.split(",") if part.strip()] if isinstance(value, str) else value


CommaInts = Annotated[
    List[Annotated[int, Field(ge=1)]], Field(min_length=1), BeforeValidator(_comma_ints), flag(metavar="<n,n,...>")
]  # positive, at least one
CommaWords = Annotated[List[str], BeforeValidator(_comma_words), flag(metavar="<a,b,...>")]

# ---- options several commands share (each command sets its own default) ----
JsonPath = Annotated[Optional[Path], Field(description="Write the results as JSON here."), flag("--json")]
Progress = Annotated[bool, Field(description="Progress bars on stderr.")]
Threads = Annotated[Optional[int], Field(ge=1, description="torch threads; none given: torch's choice.")]
ChatTemplate = Annotated[bool, Field(description="Wrap text prompts (and chats) in the model's chat template.")]
Short = Annotated[int, Field(ge=1, description="seed-mix: output tokens of the short half.")]
Long = Annotated[int, Field(ge=1, description="seed-mix: output tokens of the long half.")]
RequestRate = Annotated[float, Field(gt=0, description="Requests/s; inf: all at once."), flag("--request-rate")]
Conversations = Annotated[int, Field(ge=1, description="multi-turn: conversations.")]
Turns = Annotated[int, Field(ge=1, description="multi-turn: turns per conversation, each sent when the previous one has ended.")]
FirstTurnLen = Annotated[int, Field(ge=1, description="multi-turn: tokens of each conversation's opening passage.")]
ThinkTime = Annotated[float, Field(ge=0, description="multi-turn: seconds between a reply's end and the conversation's next turn.")]
ConstrainedRequests = Annotated[int, Field(ge=0, description="Requests that are JSON-constrained (a schema they never complete: same lengths).")]
Timeout = Annotated[Optional[float], Field(gt=0, description="Bound on the run in seconds; requests not done are cancelled and counted as errors.")]
Workload = Annotated[str, flag("--workload", "-w")]


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class OfflineOptions(_Options):
    """``carpool bench offline``."""

    workload: Workload = Field(
        "seed-mix",
        description="seed-example (the article's A-E on 4 seats), seed-mix (half 20, half 200 tokens), sweep "
        "(exponential lengths capped at --caps), input-grounded (the answer repeats or edits a paragraph or function "
        "in the prompt; 128-200 tokens), or a JSONL file of {prompt, max_tokens}.",
    )
    num_requests: int = Field(100, ge=1, description="seed-mix, sweep and input-grounded: number of requests.")
    short: Short = 20
    long: Long = 200
    mean_tokens: float = Field(64.0, ge=1.0, description="sweep: mean of the exponential output length.")
    caps: CommaInts = Field("32,128,512", description="sweep: comma-separated caps on the output length.")
    seed: int = Field(0, description="sweep: seed of the length draw; input-grounded: of the prompts and lengths.")
    compare: Annotated[List[str], flag(multiple=True, metavar="<str>")] = Field(
        [], description="Also run 'transformers' (static generate, and its continuous batching when available) or "
        "'transformers-static' (generate only); ratios to Carpool. Repeatable.",
    )
    json_path: JsonPath = None
    plot: Optional[Path] = Field(
        None, description="Write PNGs PATH-occupancy.png and PATH-latency.png (sweep: PATH-sweep.png)."
    )
    threads: Threads = None
    chat_template: ChatTemplate = True
    progress: Progress = True
    prompt_logprobs_requests: int = Field(
        0, ge=0, description="The first N requests also score their prompt (prompt_logprobs=1); not with sweep."
    )
    constrained_requests: ConstrainedRequests = Field(0, description="The last N requests are JSON-constrained (a "
                                                         "schema they never complete: same lengths); not with sweep.")


class PrefixOptions(_Options):
    """``carpool bench prefix``."""

    workload: Annotated[List[str], flag("--workload", "-w", multiple=True, metavar="<str>")] = Field(
        ["shared-prefix", "multi-turn"],
        description="shared-prefix (one long system prompt, distinct short questions) and/or multi-turn (each turn "
        "resends the conversation so far); repeat the option for both.",
    )
    num_requests: int = Field(64, ge=1, description="shared-prefix: requests.")
    system_prompt_len: int = Field(512, ge=1, description="shared-prefix: tokens of the shared system prompt's text.")
    output_len: int = Field(32, ge=1, description="Output tokens of every request (greedy, ignore_eos).")
    request_rate: RequestRate = Field(math.inf, description="shared-prefix: requests/s, evenly spaced; inf: all at once.")
    conversations: Conversations = Field(16, description="multi-turn: conversations, all starting at once.")
    turns: Turns = 4
    first_turn_len: FirstTurnLen = 256
    think_time: ThinkTime = 0.0
    caching: Annotated[List[str], flag(multiple=True, metavar="<on|off>")] = Field(
        ["on", "off"], description="Which settings to run: on and/or off (both: the ratios)."
    )
    threads: Threads = None
    chat_template: ChatTemplate = True
    json_path: JsonPath = None
    progress: Progress = True


class ServeBenchOptions(_Options):
    """``carpool bench serve`` (the API key is the server's own setting, ``api_key``)."""

    url: str = Field("http://127.0.0.1:8000/v1", description="Base URL of the OpenAI-compatible API.")
    model: Optional[str] = Field(None, description="Model name (default: the first id of GET /v1/models).")
    num_prompts: Annotated[int, flag("--num-prompts", "-n")] = Field(100, ge=1, description="Number of requests.")
    request_rate: RequestRate = Field(math.inf, description="Requests/s, Poisson arrivals (exponential gaps); inf: all at once.")
    seed: int = Field(0, description="Seed of the inter-arrival gaps (and of input-grounded's prompts).")
    workload: Workload = Field(
        "seed-mix",
        description="seed-mix (half --short, half --long output tokens), input-grounded (the answer repeats or edits a "
        "paragraph or function in the prompt; 128-200 tokens), multi-turn (conversations whose every turn resends the "
        "chat so far) or a JSONL file of {prompt, max_tokens}.",
    )
    short: Short = 20
    long: Long = 200
    max_tokens: Optional[int] = Field(
        None, ge=1, description="Output tokens of every request (overrides the workload's; multi-turn: default 32)."
    )
    conversations: Conversations = Field(16, description="multi-turn: conversations (they start at --request-rate; inf: all at once).")
    turns: Turns = 4
    first_turn_len: FirstTurnLen = 256
    think_time: ThinkTime = 0.0
    tokenizer: Optional[str] = Field(
        None, description="Tokenizer (hub id or folder) for multi-turn and the best possible hit rate (default: the "
        "root model of GET /v1/models).",
    )
    metrics_url: Optional[str] = Field(
        None, description="Prometheus endpoint for the prefix cache hit rate (default: /metrics next to /v1)."
    )
    timeout: Timeout = None
    max_concurrency: Optional[int] = Field(None, ge=1, description="Most requests in flight at once (default: unbounded).")
    priority: int = Field(0, description="Priority of every request (vLLM's: lower runs first; not 0 needs a server "
                          "with --scheduling-policy priority).")
    slo_ttft_ms: Optional[float] = Field(
        None, gt=0, description="TTFT target of every request (header x-slo-ttft-ms): reports how many met it."
    )
    slo_tpot_ms: Optional[float] = Field(
        None, gt=0, description="Time-per-output-token target of every request (header x-slo-tpot-ms)."
    )
    shed: bool = Field(
        False, description="Ask to be shed rather than served late (header x-slo-shed; needs --slo-ttft-ms): a 429 "
        "slo_unattainable counts as shed, not as an error.",
    )
    json_path: JsonPath = None
    progress: Progress = True


class OverheadOptions(_Options):
    """``carpool bench overhead`` (the seed mix)."""

    num_requests: int = Field(100, ge=1, description="Requests of the seed mix.")
    short: Short = 20
    long: Long = 200
    request_rate: RequestRate = Field(math.inf, description="Served run: requests/s, Poisson arrivals; inf: all at once.")
    threads: Threads = None
    json_path: JsonPath = None
    progress: Progress = True


class ProfileOptions(_Options):
    """``carpool bench profile``."""

    workload: Workload = Field(
        "seed-mix", description="seed-mix or input-grounded (the answer repeats or edits a paragraph or function in the prompt)."
    )
    num_requests: int = Field(100, ge=1, description="Requests of the workload.")
    skip: int = Field(20, ge=0, description="Steps run before profiling.")
    steps: int = Field(20, ge=1, description="Steps profiled.")
    threads: Threads = None
    top: int = Field(8, ge=1, description="Operators listed.")
    json_path: JsonPath = None
    constrained_requests: ConstrainedRequests = Field(0, description="The first N requests are JSON-constrained (same lengths).")


def _known(kind: str, names: list[str], known) -> list[str]:
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"unknown {kind}(s) {unknown}; choose from {', '.join(known)}")
    return names


def _spec_workloads(value: list[str]) -> list[str]:
    from cluster.bench.engine.spec_bench import WORKLOADS

    return _known("workload", value, sorted(WORKLOADS))


def _policies(value: list[str]) -> list[str]:
    from cluster.bench.serving.autoscale import POLICIES

    return _known("policy", value, POLICIES)


class SpecOptions(_Options):
    """``carpool bench spec``."""

    seats: CommaInts = Field("1,4", description="Comma-separated seat counts (max_num_seqs), one pair of engines each.")
    workloads: Annotated[CommaWords, AfterValidator(_spec_workloads)] = Field(
        "input-grounded,seed-mix", description="Comma-separated: input-grounded, seed-mix."
    )
    num_requests: int = Field(8, ge=1, description="Requests per workload and seat count (at least twice the seats).")
    threads: Threads = 1
    json_path: JsonPath = None


class LoRAOptions(_Options):
    """``carpool bench lora``."""

    seats: CommaInts = Field("32", description="Comma-separated seat counts (max_num_seqs), one pair of engines each.")
    adapters: int = Field(4, ge=1, description="Random adapters mixed with the base model (max_loras).")
    rank: int = Field(16, ge=1, description="Their rank (max_lora_rank).")
    num_requests: int = Field(64, ge=1, description="Requests per run (at least twice the seats).")
    threads: Threads = 1
    json_path: JsonPath = None


class LoRARoutingOptions(_Options):
    """``carpool bench lora-routing``."""

    adapters: int = Field(8, ge=1, description="Random adapters made with peft and served.")
    rank: int = Field(8, ge=1, description="The adapters' rank.")
    num_requests: Annotated[int, flag("--num-requests", "-n")] = Field(96, ge=1, description="Requests per mode.")
    hot: int = Field(2, ge=0, description="Hot adapters: together they draw --hot-fraction of the requests.")
    hot_fraction: float = Field(0.6, ge=0.0, le=1.0, description="The hot adapters' share of the requests.")
    max_tokens: int = Field(
        16, ge=1, description="Mean output tokens of a request: each draws from half to 1.5 times it (greedy, ignore_eos)."
    )
    concurrency: int = Field(8, ge=1, description="Clients sending requests in a closed loop.")
    seed: int = Field(0, description="Seed of the adapters' weights and of the requests' adapters.")
    modes: Annotated[List[str], flag("--mode", multiple=True, metavar="<aware|seat-only>")] = Field(
        ["aware", "seat-only"], description="aware (lora_aware_routing on) and/or seat-only (off); repeat for both."
    )
    adapter_dir: Optional[Path] = Field(None, description="Write the adapters here and keep them (default: a temporary folder).")
    timeout: Timeout = Field(None, description="Bound on each mode's run in seconds.")
    json_path: JsonPath = None


class AutoscaleOptions(_Options):
    """``carpool bench autoscale``."""

    policies: Annotated[CommaWords, AfterValidator(_policies)] = Field(
        "carpool,ongoing_requests", description="Comma-separated policies, run in turn: carpool, ongoing_requests."
    )
    prometheus: Optional[str] = Field(
        None, description="Path of a prometheus binary: read the Carpool policy's series back from a real Prometheus."
    )
    shape: Literal["steady", "rounds", "poisson", "tiny"] = Field(
        "steady",
        description=(
            "The long phase's load: steady (8 closed-loop clients), rounds (10 requests at once, the next round once "
            "all ended), poisson (open-loop arrivals at 1.5 times one replica's capacity), tiny (no long phase)."
        ),
    )
    json_path: JsonPath = None
