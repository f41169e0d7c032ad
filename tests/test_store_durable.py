"""Durable puts: ``put(..., durable=True)``, ``write_policy: through`` and ``x-kvgate-durable``.

A durable put returns once every lower tier holds the object and raises that tier's error
otherwise; a write-back put returns once the first tier holds it. The lower tiers are real: a
Redis server (stopped to fail it), a file tier on a 2 MiB tmpfs (full to fail it), and memory
connectors behind a gate that holds their writes until the test lets them go.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from servers.asgi import serve
from servers.gated import Gated
from servers.redis import RedisNode

from connectors.memory import MemoryConnector
from connectors.redis import RedisConnector
from gateway import CapacityError, Store
from gateway.codec import encode_frame
from gateway.errors import Timeout, Unavailable
from gateway.http.app import create_app
from gateway.http.batch import entry_head
from gateway.layers import ChaosLayer
from gateway.objects import to_object_data
from gateway.registry import load_codec

KiB, MiB = 1 << 10, 1 << 20


def config(*lower: dict[str, Any], l1: int = 4 * MiB, **store: Any) -> dict[str, Any]:
    tiers = [{"url": "memory://", "capacity": l1}]
    tiers += [{"url": "memory://", "timeout": 5.0, **t} for t in lower]
    return {"tiers": tiers, "staging": 8 * MiB, **store}


def redis_tier(node: RedisNode) -> dict[str, Any]:
    return {
        "url": node.url,
        "timeout": 1.0,
        "retry": {"attempts": 1},
        "options": {"socket_connect_timeout": 0.5},
    }


async def test_durable_put_fails_on_a_stopped_redis_while_write_back_returns(
    redis_factory: Callable[..., RedisNode],
) -> None:
    node = redis_factory()
    async with Store({"tiers": [{"url": "memory://", "capacity": 4 * MiB}, redis_tier(node)]}) as s:
        await s.put("before", b"v", durable=True)
        node.stop()
        await s.put("k", b"write-back")  # in memory; the Redis write fails in the background
        assert await s.get("k") == b"write-back"
        with pytest.raises(Unavailable):
            await s.put("d", b"durable", durable=True)
        with pytest.raises(Unavailable):
            await s.put_many([("m", b"durable")], durable=True)
        await s.flush()


async def test_durable_put_returns_once_every_tier_holds_the_object(
    redis_factory: Callable[..., RedisNode], tmp_path: Path
) -> None:
    node = redis_factory()
    cfg = {
        "tiers": [
            {"url": "memory://", "capacity": 4 * MiB},
            {"url": f"file://{tmp_path}/disk"},
            redis_tier(node),
        ]
    }
    redis = RedisConnector.from_url(node.url)  # a client of its own, beside the store's
    try:
        async with Store(cfg) as store:
            disk = store.tiers[0].connector  # the directory is locked by the store's tier
            for i, size in enumerate((100, 600 * KiB)):  # an inline and a parted Redis object
                await store.put(f"k{i}", b"x" * size, durable=True)
                # No flush: the put itself waited for both lower tiers.
                assert await disk.get(f"k{i}") is not None
                assert await redis.get(f"k{i}") is not None
    finally:
        await redis.close()


async def test_durable_put_waits_for_the_lower_tier() -> None:
    lower = Gated()
    async with Store(config({}), connectors={1: lower}) as store:
        lower.gate.clear()
        await store.put("back", b"v")  # write-back: returns with the write still held
        assert "back" not in lower.backing.objects
        durable = asyncio.create_task(store.put("k", b"v", durable=True))
        await asyncio.sleep(0.1)
        assert not durable.done()  # held with the tier's write
        lower.gate.set()
        await durable
        assert "k" in lower.backing.objects


async def test_write_policy_through_makes_every_put_durable() -> None:
    down = ChaosLayer(MemoryConnector(), down=True)
    cfg = config({"breaker": {"failures": 0}}, write_policy="through")
    async with Store(cfg, connectors={1: down}) as store:
        with pytest.raises(Unavailable, match="chaos"):
            await store.put("k", b"v")
        down.down = False
        await store.put("k", b"v")
        assert "k" in down.inner.objects  # type: ignore[attr-defined]


async def test_durable_put_raises_the_tiers_own_error_kind() -> None:
    stuck = ChaosLayer(MemoryConnector(), latency=5.0)
    cfg = config({"timeout": 0.2, "retry": {"attempts": 1}})
    async with Store(cfg, connectors={1: stuck}) as store:
        with pytest.raises(Timeout):
            await store.put("k", b"v", durable=True)
        stuck.latency = 0.0
        await store.flush()


async def test_durable_put_on_a_full_disk_is_a_capacity_error(small_disk: Path) -> None:
    cfg = {"tiers": [{"url": "memory://", "capacity": 8 * MiB}, {"url": f"file://{small_disk}"}]}
    async with Store(cfg) as store:
        await store.put("fits", b"x" * 1000, durable=True)
        await store.put("big", b"x" * (3 * MiB))  # write-back: in memory, the disk refuses it
        with pytest.raises(CapacityError):
            await store.put("big2", b"x" * (3 * MiB), durable=True)
        await store.flush()


async def test_durable_http_put_answers_with_the_tiers_error(small_disk: Path) -> None:
    cfg = {"tiers": [{"url": "memory://", "capacity": 8 * MiB}, {"url": f"file://{small_disk}"}]}
    app = create_app(cfg, max_body=8 * MiB, body_pool=16 * MiB)
    body = b"x" * (3 * MiB)
    async for url in serve(app):
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            assert (await client.put("/v1/objects/a", content=body)).status_code == 204
            durable = {"x-kvgate-durable": "true"}
            r = await client.put("/v1/objects/b", content=body, headers=durable)
            assert r.status_code == 413
            assert r.json()["error"] == "capacity"
            r = await client.put("/v1/objects/c", content=b"small", headers=durable)
            assert r.status_code == 204
            disk = app.state.kvgate.store.tiers[0].connector
            assert await disk.exists("c")  # no flush: on disk when the 204 came
            r = await client.put("/v1/objects/c", content=b"x", headers={"x-kvgate-durable": "y"})
            assert r.status_code == 400
            head, parts, _ = encode_frame(load_codec("raw"), to_object_data(body))
            frame = head + b"".join(parts)
            batch = entry_head("e", len(frame)) + frame
            r = await client.post("/v1/batch/put", content=batch)
            assert r.status_code == 204
            r = await client.post("/v1/batch/put", content=batch, headers=durable)
            assert r.status_code == 413


async def test_superseded_durable_put_returns_and_the_newer_put_decides() -> None:
    lower = Gated()
    async with Store(config({"workers": 1}), connectors={1: lower}) as store:
        lower.gate.clear()
        await store.put("k", b"v0")  # its write is running, held at the gate
        await lower.reached.wait()
        durable = asyncio.create_task(store.put("k", b"v1", durable=True))
        await asyncio.sleep(0.1)  # waiting for v0's write to finish before writing v1
        await store.put("k", b"v2")  # newer: v1's write will never run
        lower.gate.set()
        await durable  # superseded is not a failure
        await store.flush()
        assert store.l1 is not None
        store.l1.remove("k")
        assert await store.get("k") == b"v2"
        assert lower.started == 2  # v0 and v2: v1 was never written


async def test_durable_put_is_not_skipped_by_backpressure() -> None:
    lower = Gated()
    cfg = config({"workers": 1, "queue_size": 1, "backpressure": "skip"})
    async with Store(cfg, connectors={1: lower}) as store:
        lower.gate.clear()
        await store.put("b0", b"v")
        await lower.reached.wait()  # b0's write is running
        for i in range(1, 4):  # one queued, two skipped
            await store.put(f"b{i}", b"v")
        skipped = store.stats()["memory1"].skipped_writes
        assert skipped == 2
        durable = asyncio.create_task(store.put("d", b"v", durable=True))
        await asyncio.sleep(0.1)
        assert not durable.done()
        lower.gate.set()
        await durable
        assert "d" in lower.backing.objects
        assert store.stats()["memory1"].skipped_writes == skipped


async def test_object_too_big_for_the_pool_fails_like_any_durable_put() -> None:
    good, down = MemoryConnector(), ChaosLayer(MemoryConnector(), down=True)
    cfg = config({}, {"breaker": {"failures": 0}}, l1=64 * KiB)
    async with Store(cfg, connectors={1: good, 2: down}) as store:
        big = b"y" * (256 * KiB)
        await store.put("big", big)  # one lower tier took it: a write-back put succeeds
        assert await store.get("big") == big
        with pytest.raises(Unavailable, match="chaos"):
            await store.put("big", big, durable=True)
    only_down = ChaosLayer(MemoryConnector(), down=True)
    cfg = config({"breaker": {"failures": 0}}, l1=64 * KiB)
    async with Store(cfg, connectors={1: only_down}) as store:
        with pytest.raises(Unavailable, match="chaos"):  # the tier's error, write-back too
            await store.put("big", b"y" * (256 * KiB))


async def test_cancelled_durable_put_leaks_no_slab() -> None:
    lower = Gated()
    async with Store(config({}), connectors={1: lower}) as store:
        assert store.pool is not None
        lower.gate.clear()
        durable = asyncio.create_task(store.put("k", b"x" * (100 * KiB), durable=True))
        await asyncio.sleep(0.1)
        durable.cancel()
        with pytest.raises(asyncio.CancelledError):
            await durable
        writer = store.writers[0]
        assert not writer.latest
        assert not writer.running
        assert writer.in_flight == 0
        assert "k" in writer.stale  # the tier may or may not hold it: never read from it
        lower.gate.set()
        assert await store.delete("k")
        gc.collect()
        assert store.pool.used == 0


async def test_durable_put_without_a_memory_tier_stages_nothing() -> None:
    """No memory tier: the caller's buffer outlives a durable put, so the tiers are written
    from it and the staging pool stays empty; both tiers hold the same verified bytes."""
    first, second = Gated(), Gated()
    cfg = {
        "tiers": [{"url": "memory://one", "timeout": 5.0}, {"url": "memory://two", "timeout": 5.0}],
        "staging": 8 * MiB,
    }
    data = bytes(range(256)) * (12 * KiB)  # 3 MiB
    async with Store(cfg, connectors={0: first, 1: second}) as store:
        assert store.pool is not None
        second.gate.clear()
        put = asyncio.create_task(store.put("k", data, durable=True))
        await second.reached.wait()
        assert store.pool.used == 0  # nothing was copied for the held write
        assert not put.done()
        second.gate.set()
        await put
        assert await store.get("k") == data
    for tier in (first, second):  # each alone: the frame's checksum matches its bytes
        space = MemoryConnector.from_url(f"memory://{tier.backing.name}")  # the same objects
        async with Store({"tiers": [{"url": "memory://only"}]}, connectors={0: space}) as alone:
            assert await alone.get("k") == data
            assert not any(s.errors or s.corrupt for s in alone.stats().values())
