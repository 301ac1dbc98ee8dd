"""Speculative decoding's counters (plain data): what the engine reports and the metrics export."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Speculative decoding counters since start (vLLM's ``spec_decode`` counters): rows verified
    with at least one draft (``num_drafts``), drafted tokens, accepted tokens, and accepted tokens
    by draft position (``accepted_per_position[j]``: how often draft ``j``, 0-based, was accepted)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """One row verified: ``num_drafted`` drafts (≥ 1), of which the first ``num_accepted`` were kept."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafted:
            self.accepted_per_position += [0] * (num_drafted - len(self.accepted_per_position))
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted ÷ drafted tokens (0 with no drafts)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verified row emits on average: 1 + accepted ÷ rows (vLLM's mean acceptance length)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens, "accepted_per_position": list(self.accepted_per_position),
            "acceptance_rate": self.acceptance_rate, "mean_acceptance_length": self.mean_acceptance_length,
        }
