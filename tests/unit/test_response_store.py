"""The response store (``router/responses/store.py``): the in-memory LRU's byte bound, expiry and
refusals, and how the ingress opens a store (the deployment's client, none, or an external
class by import path)."""

from __future__ import annotations

import asyncio

import pytest

from router.responses.store import MemoryStore, RecordTooLarge, ResponseStore, ServeStoreClient, open_store


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_least_recently_used_go_first_when_bytes_run_out():
    store = MemoryStore(max_bytes=30, ttl_s=100)
    store.put("a", b"x" * 10)
    store.put("b", b"x" * 10)
    store.put("c", b"x" * 10)
    assert store.get("a") == b"x" * 10  # a is now the most recently used: b goes first
    store.put("d", b"y" * 15)
    assert store.get("b") is None and store.get("c") is None
    assert store.get("a") is not None and store.get("d") == b"y" * 15
    assert store.stats() == {"records": 2, "bytes": 25, "max_bytes": 30, "evicted": 2, "expired": 0}


def test_a_record_larger_than_the_bound_is_refused_and_nothing_is_evicted():
    store = MemoryStore(max_bytes=10, ttl_s=100)
    store.put("a", b"1234")
    with pytest.raises(RecordTooLarge, match="11 bytes"):
        store.put("b", b"x" * 11)
    assert store.get("a") == b"1234" and store.bytes == 4


def test_records_expire_from_when_they_were_put():
    clock = Clock()
    store = MemoryStore(max_bytes=100, ttl_s=10, clock=clock)
    store.put("a", b"1")
    clock.now = 5
    store.put("b", b"2")
    assert store.get("a") == b"1"
    clock.now = 10  # a's 10 s are over, b's are not
    assert store.get("a") is None and store.get("b") == b"2"
    clock.now = 16
    store.put("c", b"3")  # a put drops the expired at the LRU end
    assert store.stats()["records"] == 1 and store.stats()["expired"] == 2


def test_replacing_and_deleting_keep_the_byte_count():
    store = MemoryStore(max_bytes=100, ttl_s=10)
    store.put("a", b"12345")
    store.put("a", b"12")
    assert store.bytes == 2
    assert store.delete("a") and not store.delete("a") and store.bytes == 0


class DictStore:
    """An external store as a user would write one (e.g. over Redis)."""

    def __init__(self, prefix: str = "") -> None:
        self.prefix, self.data = prefix, {}

    async def put(self, key: str, value: bytes) -> None:
        self.data[self.prefix + key] = value

    async def get(self, key: str) -> bytes | None:
        return self.data.get(self.prefix + key)

    async def delete(self, key: str) -> bool:
        return self.data.pop(self.prefix + key, None) is not None


class NotAStore:
    def __init__(self) -> None:
        pass


def test_open_store_by_kind():
    assert open_store("none", {}, None) is None
    assert isinstance(open_store("serve", {}, object()), ServeStoreClient)
    store = open_store(f"{__name__}:DictStore", {"prefix": "p:"}, None)
    assert isinstance(store, ResponseStore) and store.prefix == "p:"
    asyncio.run(store.put("k", b"v"))
    assert asyncio.run(store.get("k")) == b"v" and store.data == {"p:k": b"v"}
    with pytest.raises(ValueError, match="cannot be loaded"):
        open_store(f"{__name__}:Missing", {}, None)
    with pytest.raises(ValueError, match="lacks put, get or delete"):
        open_store(f"{__name__}:NotAStore", {}, None)


def test_the_setting_names_a_store_kind():
    from router.config import IngressConfig

    assert IngressConfig(response_store="mypkg.stores:RedisStore").response_store == "mypkg.stores:RedisStore"
    for bad in ("redis", "mypkg:", ":Cls", "mypkg:not a name"):
        with pytest.raises(ValueError, match="'serve', 'none' or 'module:Class'"):
            IngressConfig(response_store=bad)
