"""A request's latency targets from its HTTP headers, named as llm-d's predicted-latency routing
names them: ``x-slo-ttft-ms`` (time to first token) and ``x-slo-tpot-ms`` (time per output token
after the first), in milliseconds; and ``x-slo-shed: true``, Carpool's: refuse the request at once
(429 with ``Retry-After``) when a replica predicts its first token later than its TTFT target,
instead of serving it late. (llm-d sheds the requests of negative priority; Carpool's priority is
vLLM's, where a negative one runs first, so shedding is asked for by its own header.)
"""

# No "from __future__ import annotations", as in the rest of router/request (FastAPI).
import math
import re
from collections.abc import Mapping
from typing import Optional

from replica.protocol.slo import LatencyTargets
from router.request.protocol import OpenAIError

TTFT_HEADER = "x-slo-ttft-ms"
TPOT_HEADER = "x-slo-tpot-ms"
SHED_HEADER = "x-slo-shed"
TRUE = ("true", "1", "yes")
FALSE = ("false", "0", "no")


def latency_targets(headers: Mapping[str, str]) -> Optional[LatencyTargets]:
    """The targets the headers set (:class:`~replica.protocol.slo.LatencyTargets`, seconds), or
    None when they set none.

    Raises:
        OpenAIError: 400 naming the header: a target that is not a positive, finite number of
            milliseconds; an ``x-slo-shed`` other than true/false (1/0, yes/no); shedding asked
            without a TTFT target to shed against.
    """
    ttft = _milliseconds(headers, TTFT_HEADER)
    tpot = _milliseconds(headers, TPOT_HEADER)
    shed = _flag(headers, SHED_HEADER)
    if shed and ttft is None:
        raise OpenAIError(f"{SHED_HEADER}: shedding needs a time-to-first-token target ({TTFT_HEADER})", param=SHED_HEADER)
    if ttft is None and tpot is None:
        return None
    return LatencyTargets(
        ttft_s=None if ttft is None else ttft / 1000, tpot_s=None if tpot is None else tpot / 1000, shed=shed
    )


MILLISECONDS = re.compile(r"[0-9]+(\.[0-9]*)?")
"""A target's value: decimal digits with an optional fraction (no sign, exponent or ``_``)."""


def _milliseconds(headers: Mapping[str, str], name: str) -> Optional[float]:
    raw = headers.get(name)
    if raw is None:
        return None
    value = float(raw.strip()) if MILLISECONDS.fullmatch(raw.strip()) else math.nan
    if not (math.isfinite(value) and value > 0):
        raise OpenAIError(f"{name}: must be a positive number of milliseconds, got {_shown(raw)}", param=name)
    return value


def _shown(raw: str) -> str:
    """``raw`` quoted for an error message, cut to 40 characters."""
    return repr(raw if len(raw) <= 40 else raw[:40] + "...")


def _flag(headers: Mapping[str, str], name: str) -> bool:
    raw = headers.get(name)
    if raw is None:
        return False
    value = raw.strip().lower()
    if value not in TRUE + FALSE:
        raise OpenAIError(f"{name}: must be true or false, got {_shown(raw)}", param=name)
    return value in TRUE
