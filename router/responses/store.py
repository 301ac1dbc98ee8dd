"""Where stored responses live: the :class:`ResponseStore` interface, its in-memory LRU
(:class:`MemoryStore`, run inside the ``ResponseStore`` deployment of
:mod:`router.responses.store_deployment`), the ingress's client of that deployment
(:class:`ServeStoreClient`) and the loading of an external store by import path
(:func:`open_store`).

A stored record is bytes (JSON, written by :mod:`router.responses.api`): its size is its length,
so the byte bound is exact and an external key-value store (Redis, ...) keeps it as one value.

Not in each ingress's memory: a follow-up (``previous_response_id``) may reach any ingress
replica, and an ingress or LLM replica that dies must lose nothing. The default store is one
Serve replica of its own, started and stopped with the application; killing that replica loses
what it held (Serve starts it again, empty). A store shared by several clusters, or one that
survives restarts, is an external one plugged in through ``response_store`` (docs/responses.md).
"""

from __future__ import annotations

import importlib
import time
from collections import OrderedDict
from typing import Any, Protocol, runtime_checkable


class RecordTooLarge(ValueError):
    """A record larger than the store's whole byte bound (it could never be kept)."""


@runtime_checkable
class ResponseStore(Protocol):
    """What the ingress needs of a response store: three calls, keys ``resp_<hex>``, values bytes.

    An implementation for another backend (Redis, a database) takes its settings as keyword
    arguments (``response_store_options``) and is named by ``module:Class`` in
    ``response_store``. Every ingress replica makes its own instance; they must see one state.
    """

    async def put(self, key: str, value: bytes) -> None:
        """Keep ``value`` under ``key`` (replacing any). Raises :class:`RecordTooLarge` if the
        store can never hold it."""

    async def get(self, key: str) -> bytes | None:
        """The value under ``key``, or None (never stored, deleted, expired or evicted)."""

    async def delete(self, key: str) -> bool:
        """Forget ``key``; False when it was not there."""


class MemoryStore:
    """An LRU of records in this process's memory, bounded in bytes and in age.

    Args:
        max_bytes: the values' total size at most; the least recently used go first.
        ttl_s: seconds a record is kept after it was put (OpenAI keeps stored responses 30 days);
            an expired record is dropped when met or when room is made.
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, max_bytes: int, ttl_s: float, clock: Any = time.monotonic) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._records: OrderedDict[str, tuple[float, bytes]] = OrderedDict()  # key -> (expiry, value), LRU first
        self.bytes = 0
        self.evicted = 0  # records dropped for room
        self.expired = 0  # records dropped for age

    def put(self, key: str, value: bytes) -> None:
        """Keep ``value``; raises :class:`RecordTooLarge` when ``len(value) > max_bytes``."""
        if len(value) > self.max_bytes:
            raise RecordTooLarge(f"{len(value)} bytes, over the store's bound of {self.max_bytes} bytes")
        self._drop(key)
        self._expire()
        while self._records and self.bytes + len(value) > self.max_bytes:
            _, (_, old) = self._records.popitem(last=False)
            self.bytes -= len(old)
            self.evicted += 1
        self._records[key] = (self._clock() + self.ttl_s, value)
        self.bytes += len(value)

    def get(self, key: str) -> bytes | None:
        """The value (now the most recently used), or None."""
        entry = self._records.get(key)
        if entry is None:
            return None
        if entry[0] <= self._clock():
            self._drop(key)
            self.expired += 1
            return None
        self._records.move_to_end(key)
        return entry[1]

    def delete(self, key: str) -> bool:
        return self._drop(key)

    def stats(self) -> dict[str, int]:
        """``records``, ``bytes``, ``max_bytes``, ``evicted``, ``expired``."""
        return {"records": len(self._records), "bytes": self.bytes, "max_bytes": self.max_bytes,
                "evicted": self.evicted, "expired": self.expired}

    def _drop(self, key: str) -> bool:
        entry = self._records.pop(key, None)
        if entry is not None:
            self.bytes -= len(entry[1])
        return entry is not None

    def _expire(self) -> None:
        """Drop the expired records at the LRU end (each put; a record used since then waits for
        its own turn or its next :meth:`get`)."""
        now = self._clock()
        while self._records:
            key, (expiry, _) = next(iter(self._records.items()))
            if expiry > now:
                break
            self._drop(key)
            self.expired += 1


class ServeStoreClient:
    """:class:`ResponseStore` over the ``ResponseStore`` Serve deployment's handle."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def put(self, key: str, value: bytes) -> None:
        refused = await self.handle.put.remote(key, value)
        if refused:
            raise RecordTooLarge(refused)

    async def get(self, key: str) -> bytes | None:
        return await self.handle.get.remote(key)

    async def delete(self, key: str) -> bool:
        return await self.handle.delete.remote(key)


def open_store(kind: str, options: dict[str, Any], handle: Any) -> ResponseStore | None:
    """The ingress's store: ``"serve"``, the deployment behind ``handle``; ``"none"``, None (no
    response is stored); else ``"module:Class"``, ``Class(**options)``.

    Raises:
        ValueError: a ``module:Class`` that cannot be imported, or whose instance lacks
            :class:`ResponseStore`'s methods.
    """
    if kind == "none":
        return None
    if kind == "serve":
        return ServeStoreClient(handle)
    module, _, name = kind.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"response_store {kind!r} cannot be loaded: {exc}") from None
    store = cls(**options)
    if not isinstance(store, ResponseStore):
        raise ValueError(f"response_store {kind!r} lacks put, get or delete")
    return store
