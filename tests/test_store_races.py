"""Write ordering and races through the store, on a real memory connector.

``GatedPut`` wraps the real connector so a test can hold one key's write in flight (a slow
backend) and release it at a chosen moment; reads and the data path stay the real ones.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from connectors.memory import MemoryConnector
from gateway import Store
from gateway.connector import parts_len
from gateway.layers import Layer
from gateway.types import Buffer, BufferParts

BIG = 64 << 10


class GatedPut(Layer):
    """Puts and deletes of a key wait while a gate is set for it; gets can be held back."""

    def __init__(self) -> None:
        self.backing = MemoryConnector.from_url(f"memory://{uuid.uuid4().hex}")
        super().__init__(self.backing)
        self.gates: dict[str, asyncio.Event] = {}
        self.delete_gate: asyncio.Event | None = None
        self.big_gate: asyncio.Event | None = None  # holds only writes larger than BIG
        self.get_delay = 0.0

    async def put(self, key: str, data: BufferParts) -> None:
        gate = self.gates.get(key)
        if gate is None and parts_len(data) > BIG:
            gate = self.big_gate
        if gate is not None:
            await gate.wait()
        await self.inner.put(key, data)

    async def delete(self, key: str) -> bool:
        if self.delete_gate is not None:
            await self.delete_gate.wait()
        return await self.inner.delete(key)

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


async def test_get_during_a_delete_does_not_bring_the_object_back() -> None:
    conn = GatedPut()
    async with Store(config(), connectors={1: conn}) as store:
        await store.put("k", b"v1")
        await store.flush()
        assert store.l1 is not None
        store.l1.remove("k")  # as if evicted
        conn.delete_gate = asyncio.Event()
        deleting = asyncio.create_task(store.delete("k"))  # the tier's delete is held
        await tick()
        assert await store.get("k") is None
        conn.delete_gate.set()
        assert await deleting
        assert await store.get("k") is None
        assert "k" not in store.l1


async def test_get_during_a_direct_put_does_not_promote_the_old_value() -> None:
    conn = GatedPut()
    async with Store(config(l1=64 << 10), connectors={1: conn}) as store:
        await store.put("k", b"old")
        await store.flush()
        assert store.l1 is not None
        store.l1.remove("k")
        conn.gates["k"] = asyncio.Event()
        big = b"N" * (128 << 10)  # larger than L1: written directly, held
        putting = asyncio.create_task(store.put("k", big))
        await tick()
        assert await store.get("k") is None  # the old value is being replaced: not served
        conn.gates["k"].set()
        await putting
        assert await store.get("k") == big


async def test_direct_put_and_a_later_queued_put_land_in_order() -> None:
    conn = GatedPut()
    async with Store(config(l1=64 << 10), connectors={1: conn}) as store:
        conn.big_gate = asyncio.Event()
        big = b"N" * (128 << 10)
        putting = asyncio.create_task(store.put("k", big))  # direct write, held
        await tick()
        await store.put("k", b"v3")  # queued, not held: it must wait for the direct write
        await tick()
        assert conn.tail("k") is None
        conn.big_gate.set()
        await putting
        await store.flush()
        assert conn.tail("k") == b"v3"
        assert store.l1 is not None
        store.l1.remove("k")
        assert await store.get("k") == b"v3"


async def test_cancelled_waiting_put_never_exposes_an_older_version() -> None:
    conn = GatedPut()
    busy = asyncio.Event()
    conn.gates["x"] = busy
    async with Store(config(queue_size=1, l1=None), connectors={0: conn}) as store:
        await store.put("k", b"v0")
        await store.flush()
        await store.put("x", b"xx")  # the worker is busy
        await tick()
        await store.put("k", b"v1")  # queued: acknowledged
        waiting = asyncio.create_task(store.put("k", b"v2"))  # waits for room
        await tick()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        busy.set()
        await store.flush()
        assert await store.get("k") in (None, b"v1", b"v2")  # never the older v0


@pytest.mark.parametrize("op", ["direct put", "delete"])
async def test_cancelled_direct_operation_never_exposes_an_older_version(op: str) -> None:
    conn = GatedPut()
    busy = asyncio.Event()
    conn.gates["x"] = busy
    async with Store(config(l1=None), connectors={0: conn}) as store:  # 8 MiB staging
        await store.put("k", b"v0")
        await store.flush()
        await store.put("x", b"xx")  # the only worker is busy
        await tick()
        await store.put("k", b"v1")  # queued: acknowledged
        conn.gates["k"] = asyncio.Event()
        conn.delete_gate = asyncio.Event()
        work = store.put("k", b"B" * (9 << 20)) if op == "direct put" else store.delete("k")
        task = asyncio.create_task(work)
        await tick()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        del conn.gates["k"]
        conn.delete_gate = None
        busy.set()
        await store.flush()
        got = await store.get("k")
        tag = None if got is None else bytes(memoryview(got)[:2])  # type: ignore[arg-type]
        assert tag in ((None, b"v1", b"BB") if op == "direct put" else (None, b"v1"))


def two_lower_tiers(**kw: Any) -> dict[str, Any]:
    cfg = config(**kw)
    cfg["tiers"].append(dict(cfg["tiers"][-1]))
    return cfg


async def test_a_put_is_the_newest_intent_in_every_tier_before_it_waits() -> None:
    c0, c1 = GatedPut(), GatedPut()
    async with Store(two_lower_tiers(queue_size=1), connectors={1: c0, 2: c1}) as store:
        busy = asyncio.Event()
        c0.gates["a"] = busy
        await store.put("a", b"aa")  # tier 0's worker is busy
        await tick()
        await store.put("b", b"bb")  # tier 0's queue is full
        p1 = asyncio.create_task(store.put("k", b"v1"))  # waits for room in tier 0
        await tick()
        assert store.writers[1].pending("k") is not None  # tier 1 already knows it
        p2 = asyncio.create_task(store.put("k", b"v2"))
        await tick()
        busy.set()
        await store.put("x", b"xx")  # competes for tier 0's freed slot
        await asyncio.gather(p1, p2)
        await store.flush()
        assert c0.tail("k") == c1.tail("k") == b"v2"


async def test_cancelled_delete_releases_every_tier() -> None:
    c0, c1 = GatedPut(), GatedPut()
    async with Store(two_lower_tiers(l1=None), connectors={0: c0, 1: c1}) as store:
        await store.put("k", b"v0")
        await store.flush()
        c0.delete_gate = asyncio.Event()
        deleting = asyncio.create_task(store.delete("k"))
        await tick()
        deleting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await deleting
        c0.delete_gate = None
        await store.flush()
        assert all(not w.latest and not w.running for w in store.writers)
        await store.put("k", b"v1")
        await store.flush()
        assert await store.get("k") == b"v1"


async def test_direct_put_cancelled_at_once_leaves_nothing_behind() -> None:
    conn = GatedPut()
    async with Store(config(l1=None), connectors={0: conn}) as store:  # 8 MiB staging
        await store.put("k", b"v0")
        await store.flush()
        putting = asyncio.create_task(store.put("k", b"B" * (9 << 20)))  # direct
        await asyncio.sleep(0)
        putting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await putting
        await store.flush()
        writer = store.writers[0]
        assert not writer.latest
        assert not writer.running
        got = await store.get("k")
        assert got is None or bytes(memoryview(got)[:2]) in (b"v0"[:2], b"BB")  # type: ignore[arg-type]
        await store.put("k", b"v2")
        await store.flush()
        assert await store.get("k") == b"v2"
