"""Assertions shared by the engine tests."""

from __future__ import annotations


def assert_idle(engine) -> None:
    """Every block is free, no request is left, and block accounting holds."""
    engine.check_integrity()
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0, stats
    assert stats.num_free_blocks == stats.num_total_blocks, stats
    assert not engine.scheduler.requests
