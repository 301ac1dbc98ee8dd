"""The engine's core: the scheduler, its scheduling policies, the KV block manager and request state.
Plain Python, no torch."""
