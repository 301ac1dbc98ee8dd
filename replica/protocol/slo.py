"""A request's latency targets (:class:`LatencyTargets`): time to first token, time per output
token, and whether the request would rather be refused than served late.

The ingress reads them from llm-d's request headers (``x-slo-ttft-ms``, ``x-slo-tpot-ms``; see
``router/request/slo_headers.py``) into the request's envelope. A replica refuses a request that
asked to be shed (``shed``) when it predicts the request's first token later than its target
(``replica/engine/admission.py``), and counts every other request with targets as met or missed
when it finishes (``carpool:requests_slo_total``, the goodput). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LatencyTargets:
    """Per-request latency targets (seconds; None: no target of that kind).

    Attributes:
        ttft_s: arrival to the first generated token (TTFT), as the replica measures it.
        tpot_s: mean seconds per output token after the first (TPOT: ``(finish - first token) /
            (output tokens - 1)``, vLLM's and llm-d's definition).
        shed: refuse the request at once (HTTP 429 with ``Retry-After``) when the replica predicts
            it would miss ``ttft_s``, instead of serving it late.
    """

    ttft_s: float | None = None
    tpot_s: float | None = None
    shed: bool = False

    def met(self, ttft_s: float, tpot_s: float | None) -> bool:
        """Whether a request that took ``ttft_s`` to its first token and ``tpot_s`` per later token
        (None: it had one output token at most) met every target it has."""
        if self.ttft_s is not None and ttft_s > self.ttft_s:
            return False
        return not (self.tpot_s is not None and tpot_s is not None and tpot_s > self.tpot_s)
