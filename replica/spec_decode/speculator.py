"""Speculative decoding as the engine sees it: before a step's forward, drafts for its decode rows;
after it, what was accepted (:class:`Speculator`).

Per step (the synchronous engine; speculation turns async scheduling off): the scheduler has
chosen the step's rows; :meth:`Speculator.prepare` asks the proposer what it could draft for each
plain decode row, lets the :class:`~replica.spec_decode.planner.DraftPlanner` choose how many
drafts pay, reserves their positions and blocks (:func:`replica.core.drafts.reserve_drafts`) and
puts the proposer's drafts in the rows. The model runner scores each row's drafts in the same
forward as every other row, and :func:`replica.sample.rejection_sampler.verify` keeps the tokens
the model itself would have produced. :meth:`Speculator.observe` then feeds the planner (each
request's acceptance, the step's cost) and the counters.
"""

from __future__ import annotations

import logging
import time

from replica.config.speculative_config import SpeculativeConfig
from replica.core.drafts import draft_room, reserve_drafts, set_drafts
from replica.core.scheduler_output import SchedulerOutput
from replica.spec_decode.ngram import NgramProposer
from replica.spec_decode.planner import DraftPlanner
from replica.spec_decode.proposer import Proposer
from replica.spec_decode.stats import SpecDecodeStats

logger = logging.getLogger(__name__)

# Step sizes (tokens) timed at start to seed the planner's step cost, up to the engine's largest.
SEED_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class Speculator:
    """Drafts for an engine's steps, and their outcome.

    Args:
        config: the :class:`SpeculativeConfig`.
        proposer: what drafts (default: built from ``config``; a draft model needs the engine's
            runner: :func:`replica.spec_decode.draft_model.DraftModelProposer`).
    """

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None) -> None:
        self.config = config
        self.proposer = proposer or NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.planner = DraftPlanner(config.num_speculative_tokens, config.adaptive)
        self.stats = SpecDecodeStats()
        self.propose_seconds = 0.0  # the latest prepare()'s proposing time
        logger.info(
            "speculative decoding: %s, up to %d drafts per request and step%s", config.method,
            config.num_speculative_tokens, ", as many as pay (adaptive)" if config.adaptive else ", always",
        )

    def seed_cost(self, runner, max_num_seqs: int, max_num_batched_tokens: int) -> dict[str, float]:
        """Time the runner's forwards at a few step sizes (chunks of ``1 + k`` tokens, as
        verifying rows are) up to what a step can hold, for the planner; returns a report."""
        if not self.config.adaptive:
            return {}
        k = self.config.num_speculative_tokens
        largest = min(max_num_batched_tokens, max_num_seqs * (1 + k))
        sizes = [n for n in SEED_SIZES if n <= largest]
        started = time.perf_counter()
        seconds = runner.time_forwards(sizes, 1 + k)
        self.planner.cost.seed(sizes, seconds)
        return {"spec_cost_sizes": len(sizes), "spec_cost_s": time.perf_counter() - started}

    def prepare(self, scheduler, out: SchedulerOutput) -> None:
        """Give ``out``'s plain decode rows the drafts that pay (their blocks allocated, their
        ``spec_token_ids`` set). Raises what the proposer raises (the step then fails)."""
        started = time.perf_counter()
        k = self.config.num_speculative_tokens
        rows, candidates = [], []
        for row in out.scheduled:
            room = draft_room(scheduler, out, row, k)
            available = self.proposer.available(row.request, room) if room else 0
            if available:
                rows.append(row)
                candidates.append((row.request.request_id, available))
        self.propose_seconds = 0.0
        if not rows:
            return
        base_outputs = sum(1 for row in out.scheduled if row.samples)
        counts = self.planner.plan(
            out.num_batched_tokens, base_outputs, candidates, self.proposer.seconds_per_position
        )
        chosen = [(row, count) for row, count in zip(rows, counts) if count]
        reserved = [(row, reserve_drafts(scheduler, out, row, count)) for row, count in chosen]
        reserved = [(row, count) for row, count in reserved if count]
        if reserved:
            drafts = self.proposer.propose([row for row, _ in reserved], [count for _, count in reserved])
            for (row, _), row_drafts in zip(reserved, drafts):
                set_drafts(row, row_drafts)
        self.propose_seconds = time.perf_counter() - started

    def observe(self, out: SchedulerOutput, extra_token_ids: dict[int, list[int]], step_seconds: float) -> dict | None:
        """After ``out`` was verified (``extra_token_ids``: the model runner's, tokens past each
        row's first) in ``step_seconds``: acceptance per request, the step's cost, the counters.
        Returns the step's counts for the metrics (``EngineMetrics.on_spec_decode``), or None if
        no row drafted."""
        self.planner.cost.record(out.num_batched_tokens, max(step_seconds - self.propose_seconds, 1e-6))
        step = SpecDecodeStats()
        for i, row in enumerate(out.scheduled):
            drafted = len(row.spec_token_ids)  # this step's rows: each verified its drafts
            if not drafted:
                continue
            accepted = len(extra_token_ids.get(i, ()))
            self.planner.observe(row.request.request_id, drafted, accepted)
            self.stats.observe(drafted, accepted)
            step.observe(drafted, accepted)
        if not step.num_drafts:
            return None
        return {
            "num_drafts": step.num_drafts, "num_draft_tokens": step.num_draft_tokens,
            "num_accepted_tokens": step.num_accepted_tokens, "accepted_per_position": step.accepted_per_position,
        }

    def forget(self, request_id: str) -> None:
        """The request left the running batch."""
        self.proposer.forget(request_id)
        self.planner.forget(request_id)
