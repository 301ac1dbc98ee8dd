"""Assertions shared by the engine tests."""

from __future__ import annotations

import os

# Device of the engine tests: cpu here and in CI; tests/gpu/device_check.sh sets cuda.
TEST_DEVICE = os.environ.get("CARPOOL_TEST_DEVICE", "cpu")
# The KV budget of the tests' engines (unless a test sets num_blocks): many engines of one session
# then do not each claim most of a GPU. On CPU it also fixes the pool's size per model and dtype,
# and the compiled decoder's graph depends on that size (the KV tensors' shape), so every compiled
# engine of one model and dtype at this budget shares one entry of the compile cache: SmolLM2 in
# float32 took 39 s to start with a pool of another size and 15 s from a cache hit, against 149 s
# cold, on the 2-core AVX2 machine (docs/development.md, "The suite's time").
KV_CACHE_MEMORY = 256 << 20
# Engine keyword arguments for that device.
ON_TEST_DEVICE = dict(device=TEST_DEVICE, kv_cache_memory=KV_CACHE_MEMORY)


def assert_idle(engine) -> None:
    """Every block is free, no request is left, and block accounting holds."""
    engine.check_integrity()
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0, stats
    assert stats.num_free_blocks == stats.num_total_blocks, stats
    assert not engine.scheduler.requests
