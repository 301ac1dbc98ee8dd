"""A simulated Carpool deployment for the autoscaling policy's tests (``tests/unit/test_autoscaling.py``).

Replicas of ``seats`` seats each run a continuous-batching engine at a fixed step time: a request
takes a seat when one is free (FIFO), then one step for its prompt and one per output token. A new
request goes to the started replica with the fewest requests (running + waiting), as Carpool's
router sends it to the least loaded one. Every ``sample_s`` each replica reports what
``LLMReplica.record_autoscaling_stats`` reports (running, seats, waiting, head-of-queue wait, KV
use), and every ``decide_s`` the policy gets what Serve's ``AutoscalingContext`` gives: each
metric's average over the look-back window per replica and the window's samples, as
:meth:`Load.from_metrics` reads them, then :func:`decide`. A replica the policy adds starts
``start_s`` later; one it removes takes no new request and drains (reporting nothing, as Serve
leaves a stopping replica out of the context).

Load shapes (each a ``(sim) -> None`` hook called every step; ``sim.submit`` sends a request):
:class:`Rounds` (closed-loop rounds: all clients send, the next round once every request of the
last ended), :class:`ClosedLoop` (each client sends again as soon as its request ends),
:class:`Poisson` (open-loop arrivals) and :class:`Bursts` (a batch of requests every few
seconds). Times are seconds of simulated time.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from cluster.autoscaling.policy import Load, decide, high_quantile


@dataclass
class Request:
    steps: int  # steps from a seat to the end: 1 (prompt) + output tokens
    arrived: float
    on_done: object = None  # called with the sim when it ends
    admitted: float | None = None
    ends_at_step: int = 0


@dataclass
class Replica:
    seats: int
    ready_at: float
    running: list = field(default_factory=list)
    waiting: deque = field(default_factory=deque)
    samples: list = field(default_factory=list)  # (time, {metric: value})
    draining: bool = False

    def load(self) -> int:
        return len(self.running) + len(self.waiting)


@dataclass(frozen=True)
class Sample:  # Serve's TimeStampedValue
    timestamp: float
    value: float


class Sim:
    """The deployment, the load and the policy; :meth:`run` returns the decisions."""

    def __init__(self, settings: dict, seats: int = 4, step_s: float = 0.014, low: int = 1, high: int = 2,
                 look_back_s: float = 30.0, sample_s: float = 2.0, decide_s: float = 1.0, start_s: float = 10.0) -> None:
        self.settings, self.seats, self.step_s, self.low, self.high = settings, seats, step_s, low, high
        self.look_back_s, self.sample_s, self.decide_s, self.start_s = look_back_s, sample_s, decide_s, start_s
        self.replicas = [Replica(seats, ready_at=0.0) for _ in range(max(low, 1))]
        self.target, self.state, self.step, self.now = len(self.replicas), {}, 0, 0.0
        self.decisions: list[tuple[float, int, str, Load]] = []  # (time, target, reason, load)
        self.waits: list[tuple[float, float]] = []  # (time admitted, seconds waited) of every request
        self.completed = 0

    # ---- the deployment ----
    def started(self) -> list[Replica]:
        return [r for r in self.replicas if r.ready_at <= self.now and not r.draining]

    def submit(self, output_tokens: int, on_done=None) -> None:
        replica = min(self.started(), key=Replica.load)
        replica.waiting.append(Request(1 + output_tokens, self.now, on_done))

    def _engine_step(self) -> None:
        for replica in self.replicas:
            if replica.ready_at > self.now:
                continue
            ended = [r for r in replica.running if r.ends_at_step <= self.step]
            replica.running = [r for r in replica.running if r.ends_at_step > self.step]
            while replica.waiting and len(replica.running) < replica.seats:
                request = replica.waiting.popleft()
                request.admitted, request.ends_at_step = self.now, self.step + request.steps
                replica.running.append(request)
                self.waits.append((self.now, self.now - request.arrived))
            for request in ended:
                self.completed += 1
                if request.on_done is not None:
                    request.on_done(self)
        self.replicas = [r for r in self.replicas if not (r.draining and not r.running and not r.waiting)]

    def _report(self) -> None:
        for replica in self.started():
            head = replica.waiting[0].arrived if replica.waiting else self.now
            replica.samples.append((self.now, {
                "num_running": float(len(replica.running)), "num_slots": float(replica.seats),
                "num_waiting": float(len(replica.waiting)), "queue_wait_s": self.now - head,
                "kv_cache_usage": 0.2 * len(replica.running) / replica.seats,
            }))
            replica.samples = [s for s in replica.samples if s[0] >= self.now - self.look_back_s]

    # ---- the policy, as Serve's controller runs it ----
    def _decide(self) -> None:
        reporting = [r for r in self.started() if r.samples]
        aggregated: dict = {}
        raw: dict = {}
        for i, replica in enumerate(reporting):
            for name in replica.samples[0][1]:
                values = [m[name] for _, m in replica.samples]
                aggregated.setdefault(name, {})[i] = sum(values) / len(values)
                raw.setdefault(name, {})[i] = [Sample(t, m[name]) for t, m in replica.samples]
        ongoing = sum(r.load() for r in self.replicas)
        load = Load.from_metrics(aggregated, ongoing, raw=raw, queued=0.0, since=self.now - self.look_back_s)
        current = len([r for r in self.replicas if r.ready_at <= self.now and not r.draining])
        d = decide(load, current, self.target, self.low, self.high, self.settings, self.state, self.now)
        self.state = d.state
        if d.target > self.target:
            self.replicas += [Replica(self.seats, ready_at=self.now + self.start_s) for _ in range(d.target - self.target)]
        elif d.target < self.target:
            for replica in sorted(self.started(), key=Replica.load)[: self.target - d.target]:
                replica.draining = True
        self.target = d.target
        self.decisions.append((self.now, d.target, d.reason, load))

    def run(self, shape, seconds: float) -> "Sim":
        """Run ``shape`` (called every step) for ``seconds`` of simulated time."""
        sample_every, decide_every = round(self.sample_s / self.step_s), round(self.decide_s / self.step_s)
        for self.step in range(self.step, self.step + round(seconds / self.step_s)):
            self.now = self.step * self.step_s
            shape(self)
            self._engine_step()
            if self.step % sample_every == 0:
                self._report()
            if self.step % decide_every == 0:
                self._decide()
        self.step += 1
        return self

    # ---- what the tests look at ----
    def changes(self) -> list[tuple[float, int, int]]:
        """``(time, from, to)`` of each change of the target."""
        out, before = [], None
        for t, target, _, _ in self.decisions:
            if before is not None and target != before:
                out.append((t, before, target))
            before = target
        return out

    def wait_quantile(self, since: float, until: float | None = None, q: float = 0.9) -> float:
        """The ``q`` quantile of the seconds requests admitted in ``[since, until]`` waited for a seat."""
        return high_quantile([w for t, w in self.waits if t >= since and (until is None or t <= until)], q)


class Rounds:
    """``clients`` requests of ``tokens`` output tokens at once; the next round once all ended, until ``until``."""

    def __init__(self, clients: int = 10, tokens: int = 300, until: float = float("inf")) -> None:
        self.clients, self.tokens, self.until, self.open = clients, tokens, until, 0

    def _done(self, sim: Sim) -> None:
        self.open -= 1

    def __call__(self, sim: Sim) -> None:
        if self.open == 0 and sim.now < self.until:
            self.open = self.clients
            for _ in range(self.clients):
                sim.submit(self.tokens, self._done)


class ClosedLoop:
    """``clients`` clients, each sending a request of ``tokens`` tokens as soon as its last one ended, until ``until``."""

    def __init__(self, clients: int, tokens: int = 300, until: float = float("inf")) -> None:
        self.clients, self.tokens, self.until, self.started = clients, tokens, until, False

    def _done(self, sim: Sim) -> None:
        if sim.now < self.until:
            sim.submit(self.tokens, self._done)

    def __call__(self, sim: Sim) -> None:
        if not self.started:
            self.started = True
            for _ in range(self.clients):
                sim.submit(self.tokens, self._done)


class Poisson:
    """Open-loop arrivals, ``rate`` requests a second (exponential gaps, seeded), until ``until``."""

    def __init__(self, rate: float, tokens: int = 300, until: float = float("inf"), seed: int = 0) -> None:
        self.rate, self.tokens, self.until, self.rng, self.next_at = rate, tokens, until, random.Random(seed), 0.0

    def __call__(self, sim: Sim) -> None:
        while self.next_at <= sim.now and self.next_at < self.until:
            sim.submit(self.tokens)
            self.next_at += self.rng.expovariate(self.rate)


class Bursts:
    """``size`` requests of ``tokens`` tokens at once every ``every_s`` seconds, until ``until``."""

    def __init__(self, size: int, tokens: int = 2, every_s: float = 5.0, until: float = float("inf")) -> None:
        self.size, self.tokens, self.every_s, self.until, self.next_at = size, tokens, every_s, until, 0.0

    def __call__(self, sim: Sim) -> None:
        if self.next_at <= sim.now < self.until:
            self.next_at += self.every_s
            for _ in range(self.size):
                sim.submit(self.tokens)
