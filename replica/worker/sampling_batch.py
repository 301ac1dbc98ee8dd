"""The persistent batch's sampling half: every seated request's sampling inputs, kept per seat, from
which a step's :class:`~replica.sample.metadata.SamplingMetadata` is gathered.

As vLLM v1's ``InputBatch`` keeps its sampling tensors: a request's settings are written into its
seat once, when it takes the seat (:meth:`SamplingBatch.add`, from the persistent batch's
``_sync``), and cleared when it leaves (:meth:`SamplingBatch.remove`); a step's rows are then a few
NumPy gathers (:meth:`SamplingBatch.gather`), not a rebuild from ``sampling_params`` per row and
step; while no request joins or leaves, a step with the same seats as one before gets the same
metadata object back (nothing in it changes: the output lists are the requests' own, appended to
in place). Numbers sit in column-major host arrays (one gather per kind: floats, integers, flags);
objects (logit biases as arrays, end ids, generators, constraints, prompt arrays, the request's
output token list by reference) in per-seat lists.

**Generators.** A seeded request's ``torch.Generator`` lives here, not on the request: created
from its seed when it first takes a seat, advanced by every draw. A preempted request (its status
``WAITING`` when its seat is freed) keeps its generator aside until it is seated again, so a seed
gives the same tokens whether or not the request was preempted; any other request's is dropped
when it leaves (finished, aborted, or ending with its last token in flight).

**Broken settings.** A request whose settings cannot be written (past validation, e.g. a
temperature set to None) keeps its seat with the error (:meth:`SamplingBatch.error_of`): its
forward runs, and the step sampler fails that row alone.
"""

from __future__ import annotations

import numpy as np
import torch

from replica.core.request import Request, RequestStatus
from replica.sample.metadata import GREEDY_TEMPERATURE_EPS, LogitBias, SamplingMetadata

__all__ = ["SamplingBatch"]

_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
_INTS = ("top_k", "min_tokens", "num_logprobs")
_FLAGS = ("greedy", "penalized", "has_bias", "constrained", "plain")
_DEFAULT_FLOATS = np.array([1.0, 1.0, 0.0, 1.0, 0.0, 0.0], dtype=np.float32)  # a free seat's
_DEFAULT_INTS = np.array([0, 0, -1], dtype=np.int64)
# Metadata objects kept between joins and leaves (a step's sampling rows, its verified rows, ...).
MAX_GATHERED = 4


class SamplingBatch:
    """Sampling inputs of up to ``max_seats`` seated requests.

    Args:
        max_seats: seats (the persistent batch's rows, ``max_num_seqs``).
        device: where seeded requests' generators draw (the logits' device).
    """

    def __init__(self, max_seats: int, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.floats = np.repeat(_DEFAULT_FLOATS[:, None], max_seats, axis=1)  # [6, S] float32
        self.ints = np.repeat(_DEFAULT_INTS[:, None], max_seats, axis=1)  # [3, S] int64
        self.flags = np.zeros((len(_FLAGS), max_seats), dtype=bool)  # [5, S]
        self.logit_bias: list[LogitBias | None] = [None] * max_seats
        self.end_ids: list[frozenset[int]] = [frozenset()] * max_seats
        self.generators: list[torch.Generator | None] = [None] * max_seats
        self.grammars: list = [None] * max_seats
        self.prompts: list[np.ndarray | None] = [None] * max_seats  # penalized seats only
        self.outputs: list[list[int]] = [[] for _ in range(max_seats)]
        self.requests: list[Request | None] = [None] * max_seats
        self.errors: list[Exception | None] = [None] * max_seats
        self._parked: dict[str, tuple[Request, torch.Generator]] = {}  # preempted requests' generators
        self.num_errors = 0  # seats with an error
        self._num_seeded = self._num_constrained = 0
        self._gathered: dict[bytes, SamplingMetadata] = {}  # by seats, until a request joins or leaves

    # ---- a request joins or leaves --------------------------------------------------------------
    def add(self, seat: int, request: Request) -> None:
        """Write ``request``'s sampling inputs into free ``seat``; an error doing so stays with the
        seat (:meth:`error_of`) instead of being raised."""
        self._gathered.clear()
        self.requests[seat] = request
        self.outputs[seat] = request.output_token_ids  # by reference: appended to by the scheduler
        try:
            self._write(seat, request)
        except Exception as exc:
            self.errors[seat] = exc
            self.num_errors += 1

    def _write(self, seat: int, request: Request) -> None:
        p = request.sampling_params
        # Everything is computed before anything is stored, so a failure leaves the seat free-like.
        floats = np.array([p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.frequency_penalty,
                           p.presence_penalty], dtype=np.float32)
        ints = np.array([p.top_k, p.min_tokens, -1 if p.logprobs is None else p.logprobs], dtype=np.int64)
        penalized = p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        greedy = p.temperature < GREEDY_TEMPERATURE_EPS
        bias = LogitBias.of(p.logit_bias) if p.logit_bias else None
        end_ids = frozenset(p.stop_token_ids or ()) | frozenset(() if p.ignore_eos else request.eos_token_ids)
        prompt = np.asarray(request.prompt_token_ids, dtype=np.int64) if penalized else None
        generator = None
        if p.seed is not None:
            parked = self._parked.pop(request.request_id, None)
            generator = parked[1] if parked is not None else torch.Generator(device=self.device).manual_seed(p.seed)
        self.floats[:, seat] = floats
        self.ints[:, seat] = ints
        constrained = request.grammar is not None
        plain = greedy and not penalized and bias is None and not constrained and p.logprobs is None
        self.flags[:, seat] = (greedy, penalized, bias is not None, constrained, plain)
        self.logit_bias[seat] = bias
        self.end_ids[seat] = end_ids
        self.prompts[seat] = prompt
        self.grammars[seat] = request.grammar
        self.generators[seat] = generator
        self._num_seeded += generator is not None
        self._num_constrained += request.grammar is not None

    def remove(self, seat: int) -> None:
        """Free ``seat``; a preempted request (``WAITING``) keeps its generator for its return."""
        self._gathered.clear()
        request, generator = self.requests[seat], self.generators[seat]
        if generator is not None and request.status == RequestStatus.WAITING:
            self._parked[request.request_id] = (request, generator)
        self._num_seeded -= generator is not None
        self._num_constrained -= self.grammars[seat] is not None
        self.num_errors -= self.errors[seat] is not None
        self.floats[:, seat] = _DEFAULT_FLOATS
        self.ints[:, seat] = _DEFAULT_INTS
        self.flags[:, seat] = False
        self.logit_bias[seat] = self.generators[seat] = self.grammars[seat] = self.prompts[seat] = None
        self.requests[seat] = self.errors[seat] = None
        self.end_ids[seat] = frozenset()
        self.outputs[seat] = []

    def discard(self, request_id: str) -> None:
        """A request without a seat left the batch: drop its kept generator unless it is waiting
        to be seated again (a preempted request aborted while waiting is dropped here)."""
        parked = self._parked.get(request_id)
        if parked is not None and parked[0].status != RequestStatus.WAITING:
            del self._parked[request_id]

    @property
    def num_parked(self) -> int:
        """Generators kept for preempted requests."""
        return len(self._parked)

    def error_of(self, seat: int) -> Exception | None:
        """The error writing the seat's request raised, or None."""
        return self.errors[seat]

    # ---- a step ---------------------------------------------------------------------------------
    def gather(self, seats: np.ndarray) -> SamplingMetadata:
        """The :class:`SamplingMetadata` of ``seats`` (``[N]`` int, each a seated request's), in order:
        the same object as the last call with these seats when no request joined or left since
        (callers read it, never write it)."""
        seats = np.asarray(seats, dtype=np.int64)
        key = seats.tobytes()
        cached = self._gathered.get(key)
        if cached is not None:
            return cached
        if len(self._gathered) >= MAX_GATHERED:
            self._gathered.clear()
        self._gathered[key] = metadata = self._gather(seats)
        return metadata

    def _gather(self, seats: np.ndarray) -> SamplingMetadata:
        f, i, b = (np.take(table, seats, axis=1) for table in (self.floats, self.ints, self.flags))
        picked = seats.tolist()
        n = len(picked)
        _, any_penalized, any_bias, _, _ = b.any(axis=1).tolist() if n else (False,) * len(_FLAGS)
        return SamplingMetadata(
            temperature=f[0], top_p=f[1], min_p=f[2], repetition_penalty=f[3], frequency_penalty=f[4],
            presence_penalty=f[5], top_k=i[0], min_tokens=i[1], num_logprobs=i[2],
            greedy=b[0], penalized=b[1], has_bias=b[2], constrained=b[3], plain=b[4],
            logit_bias=[self.logit_bias[s] for s in picked] if any_bias else [None] * n,
            end_ids=[self.end_ids[s] for s in picked],
            generators=[self.generators[s] for s in picked] if self._num_seeded else [None] * n,
            grammars=[self.grammars[s] for s in picked] if self._num_constrained else [None] * n,
            prompt_token_ids=[self.prompts[s] for s in picked] if any_penalized else [None] * n,
            output_token_ids=[self.outputs[s] for s in picked],
        )
