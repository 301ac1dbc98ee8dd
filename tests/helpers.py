"""Assertions shared by the engine tests."""

from __future__ import annotations

import os

# Device of the engine tests: cpu here and in CI; tests/gpu/device_check.sh sets cuda.
TEST_DEVICE = os.environ.get("CARPOOL_TEST_DEVICE", "cpu")
# Engine keyword arguments for that device. A fixed KV budget (256 MiB, unless a test sets
# num_blocks) keeps many engines of one session from each claiming most of a GPU.
ON_TEST_DEVICE = dict(device=TEST_DEVICE, kv_cache_memory=256 << 20)


def assert_idle(engine) -> None:
    """Every block is free, no request is left, and block accounting holds."""
    engine.check_integrity()
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0, stats
    assert stats.num_free_blocks == stats.num_total_blocks, stats
    assert not engine.scheduler.requests
