"""When speculation pays: how many drafts each decode row of a step gets (none is a choice too).

A row whose drafts are each accepted with probability ``a`` (independently, the model of Leviathan
et al. 2023, section 3.1) emits ``1 + a + a^2 + ... + a^k`` tokens in expectation with ``k`` drafts:
its ``j``-th draft adds ``a^j``. A step's cost grows with its tokens (slowly while the step is bound
by reading the weights, linearly once it is compute-bound). :meth:`DraftPlanner.plan` takes the
step's expected tokens per second over every number ``m`` of drafts, given to the rows in order of
their expected gain, and keeps the best ``m``: at 1 seat on a memory-bound step it drafts fully, in
a step already full of rows, or for requests whose drafts are rejected, it drafts nothing.

The step cost comes from :class:`StepCost` (measured at start, then every step); each request's
acceptance from its own verified drafts (a decayed count of accepts and rejects with a prior). A
request given no drafts has its counts decay too, toward the prior, so that it is tried again
after a while: what the text around it says changes as it generates.
"""

from __future__ import annotations

from replica.kernels.shapes import padded_size

# Prior of a request's acceptance: PRIOR_ACCEPTS accepts and PRIOR_REJECTS rejects before any draft.
PRIOR_ACCEPTS, PRIOR_REJECTS = 1.0, 1.0
# Weight of a request's older verifications against its latest one (exponential decay per step).
DECAY = 0.8
# Speculate only where the step's expected tokens per second beats not speculating by this factor
# (a margin for the cost table's noise).
MIN_GAIN = 1.02
# Weight of the newest measurement in a cost bucket's moving average.
COST_EMA = 0.2


class StepCost:
    """Seconds a step takes by its token count, per :func:`padded_size` bucket: measured at start
    (:meth:`seed`), then each step's measured time moves its bucket's average (:meth:`record`).
    A bucket not measured yet is interpolated linearly between its measured neighbours, or
    extrapolated from the last two past the largest."""

    def __init__(self) -> None:
        self._seconds: dict[int, float] = {}

    def seed(self, num_tokens: list[int], seconds: list[float]) -> None:
        for n, t in zip(num_tokens, seconds):
            self._seconds[padded_size(n)] = t

    def record(self, num_tokens: int, seconds: float) -> None:
        bucket = padded_size(num_tokens)
        old = self._seconds.get(bucket)
        self._seconds[bucket] = seconds if old is None else (1 - COST_EMA) * old + COST_EMA * seconds

    def estimate(self, num_tokens: int) -> float:
        """Seconds for a step of ``num_tokens`` tokens (proportional to them when nothing is known)."""
        bucket = padded_size(num_tokens)
        table = self._seconds
        if bucket in table:
            return table[bucket]
        if not table:
            return float(num_tokens)
        known = sorted(table)
        below = [n for n in known if n < bucket]
        above = [n for n in known if n > bucket]
        if below and above:
            lo, hi = below[-1], above[0]
        elif len(known) >= 2:
            lo, hi = (known[-2], known[-1]) if below else (known[0], known[1])
        else:
            return table[known[0]] * bucket / known[0]
        slope = (table[hi] - table[lo]) / (hi - lo)
        return max(table[lo] + slope * (bucket - lo), 1e-9)


class DraftPlanner:
    """Chooses each step's drafts per row (see the module docstring).

    Args:
        max_drafts: ``num_speculative_tokens``.
        adaptive: False gives every row all the drafts it can have.
    """

    def __init__(self, max_drafts: int, adaptive: bool = True) -> None:
        self.max_drafts = max_drafts
        self.adaptive = adaptive
        self.cost = StepCost()
        self._counts: dict[str, tuple[float, float]] = {}  # request id -> (accepts, rejects), decayed

    def acceptance(self, request_id: str) -> float:
        """The request's estimated probability that a draft is accepted."""
        accepts, rejects = self._counts.get(request_id, (0.0, 0.0))
        return (accepts + PRIOR_ACCEPTS) / (accepts + rejects + PRIOR_ACCEPTS + PRIOR_REJECTS)

    def plan(
        self, base_tokens: int, base_outputs: int, candidates: list[tuple[str, int]], seconds_per_position: float = 0.0
    ) -> list[int]:
        """Drafts per candidate row.

        Args:
            base_tokens: tokens the step computes without drafts.
            base_outputs: tokens the step emits without drafts (its sampling rows).
            candidates: ``(request id, drafts available)`` per decode row that may draft.
            seconds_per_position: a draft position's own cost (a draft model's forward).
        Returns:
            per candidate, its number of drafts (0 to its available).
        """
        if not self.adaptive:
            return [available for _, available in candidates]
        gains = []  # (expected extra tokens, candidate index); a row's j-th draft adds a^j
        for index, (request_id, available) in enumerate(candidates):
            a = self.acceptance(request_id)
            gains += [(a**j, index) for j in range(1, available + 1)]
        gains.sort(key=lambda g: -g[0])  # stable: a row's drafts stay in order
        counts = [0] * len(candidates)
        best_m, best_rate = 0, base_outputs / self.cost.estimate(base_tokens)
        expected, deepest = float(base_outputs), 0
        for m, (gain, index) in enumerate(gains, start=1):
            expected += gain
            counts[index] += 1
            deepest = max(deepest, counts[index])
            rate = expected / (self.cost.estimate(base_tokens + m) + deepest * seconds_per_position)
            if rate > best_rate * (MIN_GAIN if best_m == 0 else 1.0):
                best_m, best_rate = m, rate
        chosen = [0] * len(candidates)
        for _, index in gains[:best_m]:
            chosen[index] += 1
        for (request_id, _), count in zip(candidates, chosen):
            if not count and request_id in self._counts:  # fades toward the prior: it tries again later
                accepts, rejects = self._counts[request_id]
                self._counts[request_id] = (DECAY * accepts, DECAY * rejects)
        return chosen

    def observe(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        """A row of the request verified ``num_drafted`` drafts and kept the first ``num_accepted``."""
        accepts, rejects = self._counts.get(request_id, (0.0, 0.0))
        self._counts[request_id] = (
            DECAY * accepts + num_accepted, DECAY * rejects + (1.0 if num_accepted < num_drafted else 0.0)
        )

    def forget(self, request_id: str) -> None:
        self._counts.pop(request_id, None)
