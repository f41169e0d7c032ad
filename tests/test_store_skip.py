"""``backpressure: skip`` with a stalled lower tier: puts land in the memory tier, the stalled
tier's writes are skipped and counted, and no put fails or waits for that tier.

The stall is a real one: the Redis server is stopped with SIGSTOP (its socket accepts, nothing
answers) and resumed with SIGCONT, always, before the test ends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from servers.gated import Gated
from servers.redis import RedisNode

from connectors.memory import MemoryConnector
from gateway import Store
from gateway.layers import ChaosLayer
from gateway.types import BufferParts

KiB, MiB = 1 << 10, 1 << 20


async def test_stalled_redis_with_skip_never_fails_a_put(
    redis_factory: Callable[..., RedisNode],
) -> None:
    node = redis_factory()
    cfg: dict[str, Any] = {
        "tiers": [
            {"url": "memory://", "capacity": 64 * MiB},
            {
                "url": node.url,
                "timeout": 2.0,
                "backpressure": "skip",
                "options": {"socket_connect_timeout": 0.5},
            },
        ]
    }
    async with Store(cfg) as store:
        assert store.l1 is not None
        await store.put("warm", b"x")
        await store.flush()  # connected before the stall
        assert node.proc is not None
        with node.proc.paused():
            # 252 puts of 1 MiB: the queue (64 jobs) alone would pin more than the pool.
            async with asyncio.timeout(30):  # a put that waited for the stalled tier: 2 s each
                for i in range(252):
                    await store.put(f"k{i}", bytes([i]) * MiB)
            stats = store.stats()["redis"]
            assert stats.skipped_writes > 0
            # The memory tier keeps serving the recent puts, not only the ones queued for Redis.
            recent = [f"k{i}" for i in range(236, 252)]
            assert all(k in store.l1 for k in recent)
            assert await store.get("k251") == bytes([251]) * MiB
        await store.flush()


async def test_queued_writes_of_a_skip_tier_make_room_for_a_put() -> None:
    lower = Gated(open=False)
    cfg = {
        "tiers": [
            {"url": "memory://", "capacity": MiB},
            {"url": "memory://", "workers": 1, "backpressure": "skip", "timeout": 5.0},
        ]
    }
    async with Store(cfg, connectors={1: lower}) as store:
        assert store.l1 is not None
        await store.put("running", b"r" * (300 * KiB))
        await lower.reached.wait()  # its write is held in the tier: it cannot be dropped
        await store.put("queued", b"q" * (200 * KiB))  # within the skip tier's share
        assert store.stats()["memory1"].skipped_writes == 0
        # The pool has 524 KiB left: the queued write is dropped to make room, not the put
        # sent to the stalled tier.
        async with asyncio.timeout(2):
            await store.put("big", b"b" * (600 * KiB))
        assert "big" in store.l1
        # Two skipped: the queued write, and big's own (it would pin more than half the pool
        # beside the running one).
        assert store.stats()["memory1"].skipped_writes == 2
        lower.gate.set()
        await store.flush()
        assert set(lower.inner.objects) == {"running"}  # type: ignore[attr-defined]
        store.l1.remove("queued")
        assert await store.get("queued") is None  # skipped: never written, never served stale


async def test_writes_are_not_dropped_when_dropping_them_frees_nothing() -> None:
    """A stalled ``wait`` tier holds the slabs too: dropping a healthy ``skip`` tier's queued
    writes of them would free no memory, so they are kept (and written)."""

    class Slow(Gated):
        async def put(self, key: str, data: BufferParts) -> None:
            await asyncio.sleep(0.05)
            await self.inner.put(key, data)

    stalled, slow = Gated(open=False), Slow()
    cfg = {
        "tiers": [
            {"url": "memory://", "capacity": MiB},
            {"url": "memory://", "workers": 1, "backpressure": "wait", "timeout": 1.0},
            {"url": "memory://", "workers": 1, "backpressure": "skip", "timeout": 5.0},
        ]
    }
    async with Store(cfg, connectors={1: stalled, 2: slow}) as store:
        for i in range(4):
            await store.put(f"k{i}", bytes([i]) * (200 * 1024))
        skipped = store.stats()["memory2"].skipped_writes
        await store.put("big", b"b" * (300 * 1024))
        assert store.stats()["memory2"].skipped_writes == skipped
        stalled.gate.set()
        await store.flush()
    assert "big" in slow.backing.objects


async def test_lookup_counts_objects_still_staged_without_a_memory_tier() -> None:
    """No memory tier: a put whose lower-tier write is still queued is served from the staging
    pool, and lookup counts it (under "staging")."""
    lower = Gated(open=False)
    cfg = {"tiers": [{"url": "memory://", "timeout": 5.0}], "staging": 4 * MiB}
    async with Store(cfg, connectors={0: lower}) as store:
        await store.put("k", b"staged")
        assert await store.get("k") == b"staged"
        assert await store.lookup(["k", "absent"]) == 1
        assert (await store.lookup_detail(["k"]))[0] == ("staging", 1)
        lower.gate.set()
        await store.flush()
        assert await store.lookup(["k"]) == 1


async def test_a_put_too_big_to_stage_skips_a_skip_tier_that_is_behind(tmp_path: Path) -> None:
    # An object larger than the pool is written to the lower tiers at once; a ``skip`` tier
    # whose workers are all stuck must be skipped then too, as its queue would skip it.
    stalled = ChaosLayer(MemoryConnector(), latency=30.0)
    cfg = {
        "tiers": [
            {"url": "memory://", "capacity": 8 << 20},
            {"url": f"file://{tmp_path}", "options": {"fsync": False}},
            {"url": "memory://", "timeout": 1.0, "backpressure": "skip", "workers": 2},
        ],
    }
    async with Store(cfg, connectors={2: stalled}) as store:
        for i in range(4):  # the stalled tier's two workers take the first two and hang
            await store.put(f"small{i}", b"s" * 1000)
        await asyncio.sleep(0.1)
        start = time.monotonic()
        await store.put("big", np.full(12 << 20, 7, dtype=np.uint8))
        assert time.monotonic() - start < 0.5
        assert store.stats()["memory2"].skipped_writes >= 1
        found = await store.get("big")
        assert isinstance(found, np.ndarray)
        assert found.nbytes == 12 << 20
        assert found[0] == 7
        stalled.latency = 0.0


async def test_a_busy_skip_tier_takes_a_direct_write_when_no_other_tier_can() -> None:
    down = ChaosLayer(MemoryConnector(), down=True)
    busy = ChaosLayer(MemoryConnector(), latency=0.3)
    cfg = {
        "tiers": [
            {"url": "memory://", "capacity": 1 << 20},
            {"url": "memory://", "timeout": 1.0},
            {"url": "memory://", "timeout": 5.0, "backpressure": "skip", "workers": 1},
        ]
    }
    async with Store(cfg, connectors={1: down, 2: busy}) as store:
        await store.put("small", b"s" * 1000)  # takes the skip tier's only worker
        await asyncio.sleep(0.05)
        assert store.writers[1].behind()
        await store.put("big", np.full(2 << 20, 7, dtype=np.uint8))  # larger than the pool
        assert await busy.exists("big")
        found = await store.get("big")
        assert isinstance(found, np.ndarray)
        assert found.nbytes == 2 << 20
        down.down = False
