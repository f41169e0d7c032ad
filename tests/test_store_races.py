"""Write ordering and races through the store, on a real memory connector.

``GatedPut`` wraps the real connector so a test can hold one key's write in flight (a slow
backend) and release it at a chosen moment; reads and the data path stay the real ones.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from connectors.memory import MemoryConnector
from gateway import Store
from gateway.layers import Layer
from gateway.types import Buffer, BufferParts


class GatedPut(Layer):
    """Puts of a key wait while a gate is set for it; gets can be held back after reading."""

    def __init__(self) -> None:
        self.backing = MemoryConnector.from_url(f"memory://{uuid.uuid4().hex}")
        super().__init__(self.backing)
        self.gates: dict[str, asyncio.Event] = {}
        self.get_delay = 0.0

    async def put(self, key: str, data: BufferParts) -> None:
        gate = self.gates.get(key)
        if gate is not None:
            await gate.wait()
        await self.inner.put(key, data)

    async def get(self, key: str) -> Buffer | None:
        data = await self.inner.get(key)
        await asyncio.sleep(self.get_delay)
        return data

    def tail(self, key: str) -> bytes | None:
        """The last bytes of the stored frame: the payload of short test values."""
        blob = self.backing.objects.get(key)
        return None if blob is None else blob[-2:]


def config(workers: int = 1, queue_size: int = 64, l1: int | None = 1 << 20) -> dict[str, Any]:
    tiers: list[dict[str, Any]] = []
    if l1 is not None:
        tiers.append({"url": "memory://", "capacity": l1})
    tiers.append({"url": "memory://", "workers": workers, "queue_size": queue_size, "timeout": 5.0})
    return {"tiers": tiers, "staging": 8 << 20}


async def tick() -> None:
    await asyncio.sleep(0.02)


async def test_delete_of_a_queued_write_is_final() -> None:
    conn = GatedPut()
    conn.gates["busy"] = asyncio.Event()
    async with Store(config(), connectors={1: conn}) as store:
        await store.put("busy", b"b")  # occupies the only worker
        await tick()
        await store.put("k", b"secret")  # queued, not started
        assert await store.delete("k")
        assert await store.get("k") is None
        assert not await store.contains("k")
        conn.gates["busy"].set()
        await store.flush()
        assert await store.get("k") is None
        assert conn.tail("k") is None


async def test_direct_put_supersedes_a_queued_write() -> None:
    conn = GatedPut()
    conn.gates["busy"] = asyncio.Event()
    async with Store(config(l1=64 << 10), connectors={1: conn}) as store:
        await store.put("busy", b"b")
        await tick()
        await store.put("k", b"old")  # queued
        big = b"N" * (128 << 10)  # larger than L1: written directly
        await store.put("k", big)
        assert await store.get("k") == big
        conn.gates["busy"].set()
        await store.flush()
        assert await store.get("k") == big


async def test_overwrites_land_in_order_with_two_workers() -> None:
    conn = GatedPut()
    first, other = asyncio.Event(), asyncio.Event()
    async with Store(config(workers=2), connectors={1: conn}) as store:
        conn.gates["k"] = first
        await store.put("k", b"v1")  # worker A: writing v1, held
        await tick()
        conn.gates["x"] = other
        await store.put("x", b"xx")  # worker B: busy
        await tick()
        await store.put("k", b"v2")  # queued
        await store.put("k", b"v3")  # supersedes v2
        del conn.gates["k"]
        other.set()  # worker B is free while v1 is still in flight
        await tick()
        first.set()
        await store.flush()
        assert conn.tail("k") == b"v3"
        assert store.l1 is not None
        store.l1.remove("k")
        assert await store.get("k") == b"v3"


async def test_delete_waits_for_a_running_older_write() -> None:
    conn = GatedPut()
    gate = asyncio.Event()
    async with Store(config(), connectors={1: conn}) as store:
        conn.gates["k"] = gate
        await store.put("k", b"v1")  # running, held
        await tick()
        await store.put("k", b"v2")  # queued behind it
        deleting = asyncio.create_task(store.delete("k"))
        await tick()
        assert not deleting.done()  # the running write must finish first
        gate.set()
        assert await deleting
        await store.flush()
        assert conn.tail("k") is None
        assert await store.get("k") is None


async def test_a_put_waiting_for_queue_room_cannot_overtake_a_later_put() -> None:
    conn = GatedPut()
    busy = asyncio.Event()
    conn.gates["x"] = busy
    async with Store(config(queue_size=1), connectors={1: conn}) as store:
        await store.put("x", b"xx")  # the worker is busy
        await tick()
        await store.put("y", b"yy")  # the queue is full
        older = asyncio.create_task(store.put("k", b"v1"))  # waits for room
        await tick()
        busy.set()
        newer = asyncio.create_task(store.put("k", b"v2"))
        await asyncio.gather(older, newer)
        await store.flush()
        assert await store.get("k") == b"v2"
        assert conn.tail("k") == b"v2"


async def test_get_after_a_put_does_not_join_an_older_fetch() -> None:
    conn = GatedPut()
    async with Store(config(l1=None), connectors={0: conn}) as store:
        await store.put("k", b"v1")
        await store.flush()
        conn.get_delay = 0.2
        first = asyncio.create_task(store.get("k"))
        await tick()
        conn.get_delay = 0.0
        await store.put("k", b"v2")
        await store.flush()
        assert await store.get("k") == b"v2"
        assert await first in (b"v1", b"v2")


async def test_close_waits_for_puts_in_flight() -> None:
    backing = MemoryConnector.from_url(f"memory://{uuid.uuid4().hex}")
    store = Store(config(l1=64 << 20), connectors={1: backing})
    await store.open()
    put = asyncio.create_task(store.put("big", b"x" * (32 << 20)))  # copies in a thread
    await asyncio.sleep(0)
    await store.close()
    await put
    assert "big" in backing.objects


async def test_skipped_write_leaves_no_stale_read() -> None:
    conn = GatedPut()
    busy = asyncio.Event()
    conn.gates["x"] = busy
    cfg = config(queue_size=1)
    cfg["tiers"][1]["backpressure"] = "skip"
    async with Store(cfg, connectors={1: conn}) as store:
        await store.put("k", b"v1")
        await store.flush()
        await store.put("x", b"xx")  # the worker is busy
        await tick()
        await store.put("y", b"yy")  # the queue is full
        await store.put("k", b"v2")  # skipped: the tier keeps v1
        assert store.stats()["memory1"].skipped_writes == 1
        busy.set()
        await store.flush()
        assert conn.tail("k") == b"v1"
        assert store.l1 is not None
        store.l1.remove("k")
        assert await store.get("k") is None  # v1 is stale: never served
        assert await store.lookup(["k"]) == 0
        await store.put("k", b"v3")
        await store.flush()
        store.l1.remove("k")
        assert await store.get("k") == b"v3"
