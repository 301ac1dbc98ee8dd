"""One request as it travels from the ingress to a replica: :class:`RequestEnvelope`.

Everything a replica needs to run one request (its id, prompt token ids, sampling parameters,
adapter), scheduling fields (``priority``; ``slo``: latency targets), and
the hints the ingress computes for the request router (:class:`RoutingHints`: the prompt's prefix
block hashes, the adapter's name). The ingress builds one per choice once the request has passed
the request checks (:mod:`replica.protocol.request_checks`, ``router/request/preparation.py``); it sends it
to ``LLMReplica.generate``/``generate_all`` as the keyword :data:`ENVELOPE_KEYWORD`, and the
request router (``router/routing/``) reads the hints from that keyword. The replica trusts an
envelope and re-checks only what only it knows (its own ``max_model_len``, its adapters).

Torch- and Ray-free: the ingress, the request router and the replica all import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from replica.protocol.lora_request import LoRARequest
from replica.protocol.pooling_params import PoolingParams
from replica.protocol.prefix_hash import ROOT, block_hashes
from replica.protocol.sampling_params import SamplingParams
from replica.protocol.slo import LatencyTargets

ENVELOPE_KEYWORD = "request"
"""The keyword argument of ``LLMReplica.generate``/``generate_all`` that carries the envelope
(the request router finds it there: ``router/routing/pending.py``)."""

ROUTED_METHODS = frozenset({"generate", "generate_all"})
"""The replica methods whose calls carry an envelope (every other call is routed on load alone)."""


@dataclass(frozen=True)
class RoutingHints:
    """What the request router ranks a request's replicas on, besides their load.

    Attributes:
        block_size: tokens per KV block the hashes were computed with (the replicas' ``block_size``).
        prefix_hashes: one 32-byte digest per full block of the prompt, chained from the adapter's
            root (:mod:`replica.protocol.prefix_hash`; ``LoRARequest.hash_root``); empty for a
            prompt shorter than a block.
        adapter: the LoRA adapter's name, or None for the base model.
        continuation: the prompt continues a conversation this cluster served (a Responses
            follow-up by ``previous_response_id``): its leading blocks are that conversation's own,
            so any match of them counts, however short (the router's minimum match fraction is for
            prompts that may share only a system prompt with others).
    """

    block_size: int
    prefix_hashes: tuple[bytes, ...]
    adapter: str | None = None
    continuation: bool = False

    @classmethod
    def of(
        cls, prompt_token_ids: Sequence[int], block_size: int, lora_request: LoRARequest | None = None,
        continuation: bool = False,
    ) -> "RoutingHints":
        """The hints of a prompt (token ids) run under ``lora_request`` (None: the base model)."""
        root = lora_request.hash_root if lora_request is not None else ROOT
        return cls(
            block_size=block_size,
            prefix_hashes=tuple(block_hashes(prompt_token_ids, block_size, root)),
            adapter=lora_request.lora_name if lora_request is not None else None,
            continuation=continuation,
        )


@dataclass(frozen=True)
class RequestEnvelope:
    """One replica request (one choice of an API request), built from a checked request.

    Attributes:
        request_id: unique among the replica's requests (the ingress's ``<id>-<choice>``).
        prompt_token_ids: the prompt, token ids in ``[0, vocab_size)``.
        sampling_params: the choice's parameters (``n`` is 1: the ingress fans ``n`` out).
        routing: the request router's hints (:class:`RoutingHints`).
        lora_request: the adapter the request runs with, or None for the base model.
        priority: scheduling priority as vLLM's (lower runs first; 0 by default): the replica's
            ``priority`` scheduling policy orders its queue by it, and the request router ranks
            replicas by the requests it would not overtake (``router/routing/ranking.py``).
        slo: the request's latency targets (:class:`~replica.protocol.slo.LatencyTargets`), or
            None: the replica may refuse it when it asked to be shed and would be late
            (``replica/engine/admission.py``), and counts whether it met them.
        pooling_params: an embedding request's (:mod:`replica.protocol.pooling_params`; its
            ``sampling_params`` then generate nothing), or None for a generation request.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    routing: RoutingHints
    lora_request: LoRARequest | None = None
    priority: int = 0
    slo: LatencyTargets | None = None
    pooling_params: PoolingParams | None = None

