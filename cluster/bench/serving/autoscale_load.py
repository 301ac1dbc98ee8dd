"""Load for ``carpool bench autoscale``: the load shapes, with the real ``openai`` client, and a
sampler of the replica count.

Shapes (:data:`SHAPES`; issue 54 item 4: the policy must see all of them): **steady**
(:func:`closed_loop`: each client sends its next request as soon as its last one ended, until its
phase's deadline), **rounds** (:func:`rounds`: all clients send at once, the next round once every
request of the last ended, as a batch job does), **poisson** (:func:`poisson`: open-loop arrivals
at a fixed rate, whatever the answers) and **tiny** (the bench's burst of tiny requests alone).
Every request is greedy with ``ignore_eos``, so a complete answer has exactly ``max_tokens``
tokens: an answer with fewer, or an error, counts as lost.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

PROMPTS = (
    "Write a long story about a lighthouse keeper and the ships she guides home.",
    "Explain, step by step and at length, how a bicycle gear system works.",
    "Describe a walk through a market in a busy city, stall by stall.",
    "List the planets of the solar system and tell something about each one.",
)


@dataclass
class Outcome:
    """The requests of one phase: ``sent``, ``completed`` (all ``max_tokens`` tokens), ``truncated``
    (fewer tokens), ``failed`` (an error; its first messages in ``errors``); ``active``: in flight now."""

    sent: int = 0
    active: int = 0
    completed: int = 0
    truncated: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"sent": self.sent, "completed": self.completed, "truncated": self.truncated,
                "failed": self.failed, "errors": self.errors[:5]}


async def _one(client, model: str, prompt: str, max_tokens: int, stream: bool, outcome: Outcome) -> None:
    outcome.sent += 1
    outcome.active += 1
    try:
        if stream:
            chunks = await client.completions.create(
                model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )
            tokens = 0
            async for chunk in chunks:
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
        else:
            reply = await client.completions.create(
                model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True},
            )
            tokens = reply.usage.completion_tokens
    except Exception as exc:  # every error counts: the point is that none happens
        outcome.failed += 1
        outcome.errors.append(f"{type(exc).__name__}: {exc}"[:300])
        return
    finally:
        outcome.active -= 1
    if tokens == max_tokens:
        outcome.completed += 1
    else:
        outcome.truncated += 1
        outcome.errors.append(f"{tokens} of {max_tokens} tokens")


async def closed_loop(base_url: str, model: str, clients: int, seconds: float, max_tokens: int, stream: bool,
                      outcome: Outcome, stop=None) -> None:
    """``clients`` clients, each sending requests back to back until ``seconds`` have passed or
    ``stop()`` is true (a request started before then runs to its end)."""
    import openai

    deadline = time.monotonic() + seconds
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300) as client:

        async def loop(i: int) -> None:
            n = 0
            while time.monotonic() < deadline and not (stop is not None and stop()):
                await _one(client, model, PROMPTS[(i + n) % len(PROMPTS)], max_tokens, stream, outcome)
                n += 1

        await asyncio.gather(*(loop(i) for i in range(clients)))


async def one_request(base_url: str, model: str, max_tokens: int, stream: bool, outcome: Outcome) -> float:
    """One request alone; the seconds it took (a probe of a request's time)."""
    import openai

    started = time.monotonic()
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300) as client:
        await _one(client, model, PROMPTS[0], max_tokens, stream, outcome)
    return time.monotonic() - started


async def rounds(base_url: str, model: str, clients: int, seconds: float, max_tokens: int, stream: bool,
                 outcome: Outcome, stop=None) -> int:
    """Rounds of ``clients`` requests sent together, the next as soon as every request of the last
    ended, until ``seconds`` have passed or ``stop()`` is true (a round started before then runs
    to its end). Returns the rounds sent."""
    import openai

    deadline, sent = time.monotonic() + seconds, 0
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300) as client:
        while time.monotonic() < deadline and not (stop is not None and stop()):
            await asyncio.gather(*(
                _one(client, model, PROMPTS[(sent + i) % len(PROMPTS)], max_tokens, stream, outcome) for i in range(clients)
            ))
            sent += 1
    return sent


async def poisson(base_url: str, model: str, rate: float, seconds: float, max_tokens: int, stream: bool,
                  outcome: Outcome, seed: int = 0, stop=None) -> None:
    """Open-loop arrivals: requests ``rate`` a second on average (exponential gaps, ``seed``) for
    ``seconds`` or until ``stop()`` is true, each sent whatever the earlier ones' state; returns
    once every request sent has ended. Raises ``ValueError`` on a rate that is not positive."""
    import openai

    if not rate > 0:
        raise ValueError(f"poisson: rate must be positive requests a second, got {rate!r}")
    rng, deadline, tasks = random.Random(seed), time.monotonic() + seconds, []
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300) as client:
        while time.monotonic() < deadline and not (stop is not None and stop()):
            prompt = PROMPTS[len(tasks) % len(PROMPTS)]
            tasks.append(asyncio.create_task(_one(client, model, prompt, max_tokens, stream, outcome)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)


SHAPES = ("steady", "rounds", "poisson", "tiny")
"""The bench's load shapes (``--shape``); see the module's docstring."""


def running_replicas(app_name: str, deployment: str = "LLMReplica") -> int:
    """Replicas of ``deployment`` Serve reports RUNNING now (0 when the app is not there)."""
    from ray import serve

    app = serve.status().applications.get(app_name)
    if app is None or deployment not in app.deployments:
        return 0
    return int(app.deployments[deployment].replica_states.get("RUNNING", 0))


class Sampler:
    """Samples the running replica count every ``period_s`` in a thread: ``samples`` is a list of
    ``(seconds since start, replicas)``; ``in_flight`` the requests in flight then (``active()``)."""

    def __init__(self, app_name: str, active=lambda: 0, period_s: float = 0.5) -> None:
        self.app_name, self.period_s, self.active = app_name, period_s, active
        self.samples: list[tuple[float, int]] = []
        self.in_flight: list[int] = []
        self._stop = False
        self._start = time.monotonic()

    async def run(self) -> None:
        while not self._stop:
            n = await asyncio.to_thread(running_replicas, self.app_name)
            self.samples.append((round(time.monotonic() - self._start, 1), n))
            self.in_flight.append(self.active())
            await asyncio.sleep(self.period_s)

    def stop(self) -> None:
        self._stop = True

    def now(self) -> float:
        return time.monotonic() - self._start

    def most(self, since: float, until: float | None = None) -> int:
        """The most replicas sampled in ``[since, until]`` (seconds since start)."""
        return max((n for t, n in self.samples if t >= since and (until is None or t <= until)), default=0)

    def last(self) -> int:
        return self.samples[-1][1] if self.samples else 0

    def changes(self, since: float = 0.0) -> list[tuple[float, int, int, int]]:
        """``(time, from, to, requests in flight)`` for each change of the running count after ``since``."""
        out, previous = [], None
        for (t, n), active in zip(self.samples, self.in_flight):
            if previous is not None and n != previous and t >= since:
                out.append((t, previous, n, active))
            previous = n
        return out

    async def wait_for(self, replicas: int, timeout_s: float) -> float | None:
        """Wait until ``replicas`` run; the seconds it took, or None after ``timeout_s``."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.samples and self.samples[-1][1] == replicas:
                return time.monotonic() - start
            await asyncio.sleep(self.period_s)
        return None
