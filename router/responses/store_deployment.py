"""The ``ResponseStore`` Serve deployment: one replica holding the stored responses of the
application for every ingress replica (a :class:`~router.responses.store.MemoryStore`).

Why a deployment of its own (as :mod:`router.lora.lora_registry`): a follow-up may reach any
ingress replica; an ingress or LLM replica that dies (or is scaled down) loses nothing; Serve owns
its lifetime (it starts and stops with the application, and is started again, empty, if it dies);
it is reached through an ordinary ``DeploymentHandle``. It takes no CPU reservation
(``num_cpus: 0``): its calls are dictionary operations. ``cluster.app.build_app`` binds it when
``response_store`` is ``serve`` (the default).
"""

from __future__ import annotations

from router.responses.store import MemoryStore, RecordTooLarge


class ResponseStoreDeployment:
    """Serve deployment body.

    Args:
        max_bytes: ``response_store_max_bytes``.
        ttl_s: ``response_store_ttl_s``.
    """

    def __init__(self, max_bytes: int, ttl_s: float) -> None:
        self.store = MemoryStore(max_bytes, ttl_s)

    async def put(self, key: str, value: bytes) -> str | None:
        """Keep ``value``; returns None, or why it was refused (larger than the bound)."""
        try:
            self.store.put(key, value)
        except RecordTooLarge as exc:
            return str(exc)
        return None

    async def get(self, key: str) -> bytes | None:
        return self.store.get(key)

    async def delete(self, key: str) -> bool:
        return self.store.delete(key)

    async def stats(self) -> dict[str, int]:
        return self.store.stats()
