"""Store semantics across real tiers (memory and file connectors; chaos layers for faults)."""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from connectors.blackhole import BlackholeConnector
from connectors.fs.connector import FileConnector
from connectors.memory import MemoryConnector
from gateway import CapacityError, ConfigError, InvalidKey, Key, Store
from gateway.layers import ChaosLayer, Layer
from gateway.types import Buffer

KIB = 1024


def ns() -> str:
    return f"memory://{uuid.uuid4().hex}"


def tiers(*urls: str, l1: int | None = 16 << 20, **tier_opts: Any) -> dict[str, Any]:
    out: list[dict[str, Any]] = []
    if l1 is not None:
        out.append({"url": "memory://", "capacity": l1})
    out += [{"url": u, "timeout": 1.0, **tier_opts} for u in urls]
    return {"tiers": out, "staging": 8 << 20}


async def test_put_get_every_kind_and_same_kind_back() -> None:
    async with Store(tiers(ns())) as store:
        objs: list[object] = [
            torch.randn(4, 8, dtype=torch.bfloat16),
            torch.arange(10, dtype=torch.float32).to(torch.float8_e4m3fn),
            np.arange(12, dtype=np.float32).reshape(3, 4),
            b"bytes",
            bytearray(b"bytearray"),
            memoryview(b"memoryview"),
        ]
        for i, obj in enumerate(objs):
            await store.put(f"k{i}", obj)
        for i, obj in enumerate(objs):
            got = await store.get(f"k{i}")
            assert type(got) is type(obj)
            if isinstance(obj, torch.Tensor):
                assert isinstance(got, torch.Tensor)
                assert got.dtype == obj.dtype
                assert torch.equal(got.view(torch.uint8), obj.view(torch.uint8))
            elif isinstance(obj, np.ndarray):
                np.testing.assert_array_equal(got, obj)  # type: ignore[arg-type]
            else:
                assert bytes(got) == bytes(obj)  # type: ignore[arg-type]
        assert await store.get("missing") is None


async def test_key_objects_and_bad_keys() -> None:
    key = Key("llama", 1, 0, -0x1A2B, "bfloat16")
    async with Store(tiers()) as store:
        await store.put(key, b"x")
        assert await store.get(str(key)) == b"x"
        assert await store.contains(key)
        for bad in ("", "a\0b", "x" * 5000):
            with pytest.raises(InvalidKey):
                await store.put(bad, b"x")
            with pytest.raises(InvalidKey):
                await store.get(bad)


async def test_lower_tier_hit_is_promoted_into_l1() -> None:
    url = ns()
    async with Store(tiers(url)) as store:
        await store.put("k", b"v" * 100)
        await store.flush()
        assert store.l1 is not None
        store.l1.remove("k")
        assert await store.get("k") == b"v" * 100
        assert "k" in store.l1
        assert store.stats()["memory1"].hits == 1


async def test_tier_order_first_hit_wins() -> None:
    a, b = ns(), ns()
    async with Store(tiers(a, b, l1=None)) as store:
        await store.put("k", b"new")
        await store.flush()
    # Overwrite in b only, through a store whose only tier is b.
    async with Store(tiers(b, l1=None)) as store_b:
        await store_b.put("k", b"old-in-b")
        await store_b.flush()
    async with Store(tiers(a, b, l1=None)) as store:
        assert await store.get("k") == b"new"
        assert "get" not in store.stats()["memory1"].latency


async def test_l1_eviction_order_per_policy() -> None:
    # 1 KiB objects, capacity for exactly four; then a fifth forces one eviction.
    expected = {"lru": "b", "mru": "a", "fifo": "a", "lfu": "d", "s3fifo": "b"}
    for policy, victim in expected.items():
        cfg = {"tiers": [{"url": "memory://", "capacity": 4 * KIB, "eviction": policy}]}
        async with Store(cfg) as store:
            assert store.l1 is not None
            for k in "abcd":
                await store.put(k, b"x" * KIB)
            touches = {"lfu": "aabbcc"}.get(policy, "a")
            for k in touches:
                assert await store.get(k) is not None
            await store.put("e", b"x" * KIB)
            gone = [k for k in "abcde" if k not in store.l1]
            assert gone == [victim], policy


async def test_lookup_prefix_continues_across_tiers() -> None:
    url = ns()
    keys = [f"k{i}" for i in range(6)]
    async with Store(tiers(url)) as store:
        for k in keys:
            await store.put(k, b"x")
        await store.flush()
        assert store.l1 is not None
        for k in keys[2:]:
            store.l1.remove(k)
        lower = MemoryConnector.from_url(url)
        await lower.delete("k4")
        assert await store.lookup(keys) == 4
        assert await store.lookup_detail(keys) == [("memory0", 2), ("memory1", 2)]
        assert await store.lookup(["k0", "nope", "k1"]) == 1
        assert await store.lookup([]) == 0


async def test_flush_and_close_drain_queued_writes() -> None:
    backing = MemoryConnector.from_url(ns())  # a named space outlives close()
    slow = ChaosLayer(backing, latency=0.02)
    store = Store(tiers(ns(), workers=1), connectors={1: slow})
    async with store:
        for i in range(20):
            await store.put(f"k{i}", b"v%d" % i)
        assert len(backing.objects) < 20
    assert len(backing.objects) == 20


async def _only_in_a_slow_tier(store: Store, key: str, value: bytes) -> None:
    """Put ``key`` and drop it from the memory tier: a get must fetch it from tier 1."""
    await store.put(key, value)
    await store.flush()
    assert store.l1 is not None
    store.l1.remove(key)


def _slow_store() -> Store:
    slow = ChaosLayer(MemoryConnector(), latency=0.1)
    return Store(tiers("memory://", l1=1 << 20), connectors={1: slow})


async def test_single_flight_shares_one_fetch() -> None:
    async with _slow_store() as store:
        await _only_in_a_slow_tier(store, "k", b"v" * 1000)
        results = await asyncio.gather(*(store.get("k") for _ in range(10)))
        assert all(r == b"v" * 1000 for r in results)
        assert store.stats()["memory1"].latency["get"].n == 1


async def test_a_cancelled_get_does_not_fail_the_gets_waiting_on_its_fetch() -> None:
    async with _slow_store() as store:
        await _only_in_a_slow_tier(store, "k", b"v" * 1000)
        first = asyncio.create_task(store.get("k"))  # runs the fetch
        await asyncio.sleep(0.02)
        waiting = [asyncio.create_task(store.get("k")) for _ in range(3)]
        await asyncio.sleep(0.02)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert await asyncio.gather(*waiting) == [b"v" * 1000] * 3
        # One of the waiting gets fetched again and the others shared it: one read ended.
        assert store.stats()["memory1"].latency["get"].n == 1
        # A cancelled waiting get leaves the fetch to the others.
        await _only_in_a_slow_tier(store, "k", b"w" * 1000)
        fetching = asyncio.create_task(store.get("k"))
        await asyncio.sleep(0.02)
        leaving = asyncio.create_task(store.get("k"))
        await asyncio.sleep(0.02)
        leaving.cancel()
        assert await fetching == b"w" * 1000
        with pytest.raises(asyncio.CancelledError):
            await leaving
        assert store.stats()["memory1"].latency["get"].n == 2


async def test_failing_tier_is_a_miss_not_an_error() -> None:
    good = MemoryConnector()
    down = ChaosLayer(MemoryConnector(), down=True)
    cfg = tiers("memory://", "memory://", l1=None)
    async with Store(cfg, connectors={0: down, 1: good}) as store:
        await store.put("k", b"value")  # the down tier's write fails in the background
        await store.flush()
        assert await store.get("k") == b"value"
        assert await store.get("other") is None
        # The failing tier counts 0 and the prefix continues in the next tier.
        assert await store.lookup(["k"]) == 1
        stats = store.stats()["memory0"]
        assert sum(stats.errors.values()) >= 2
    only_down = ChaosLayer(MemoryConnector(), down=True)
    async with Store(tiers("memory://", l1=None), connectors={0: only_down}) as store:
        assert await store.get("k") is None


async def test_memory_bounded_while_lower_tier_stalls_skip() -> None:
    stalled = ChaosLayer(MemoryConnector(), latency=5.0)
    cfg = {
        "tiers": [
            {"url": "memory://", "capacity": 1 << 20},
            {
                "url": "memory://",
                "timeout": 0.3,
                "queue_size": 4,
                "workers": 1,
                "backpressure": "skip",
                "retry": {"attempts": 1},
            },
        ]
    }
    async with Store(cfg, connectors={1: stalled}) as store:
        value = b"x" * (64 * KIB)
        tracemalloc.start()
        try:
            async with asyncio.timeout(5):  # skip never makes a put wait for the tier
                for i in range(64):  # 4 MiB put through a 1 MiB memory tier
                    await store.put(f"k{i}", value)
                    assert store.writers[0].queue.qsize() <= 4
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 512 * KIB  # nothing buffered outside the fixed pool
        assert store.stats()["memory1"].skipped_writes > 0
        assert await store.get("k63") == value  # L1 kept serving


async def test_memory_bounded_while_lower_tier_stalls_wait() -> None:
    sink = BlackholeConnector()  # keeps nothing, so traced memory is the store's own
    stalled = ChaosLayer(sink, latency=0.05)
    cfg = {
        "tiers": [{"url": "memory://", "timeout": 1.0, "queue_size": 2, "workers": 1}],
        "staging": 256 * KIB,
    }
    async with Store(cfg, connectors={0: stalled}) as store:
        value = b"x" * (64 * KIB)
        loop = asyncio.get_running_loop()
        start = loop.time()
        tracemalloc.start()
        try:
            for i in range(12):  # 768 KiB through a 256 KiB staging pool
                await store.put(f"k{i}", value)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 256 * KIB
        # Back-pressure really happened: 12 writes at 50 ms each, at most 3 ahead in flight.
        assert loop.time() - start >= 0.3
        await store.flush()
        assert sink.puts == 12


async def test_object_larger_than_l1_goes_straight_to_lower_tier() -> None:
    async with Store(tiers(ns(), l1=64 * KIB)) as store:
        big = b"y" * (256 * KIB)
        await store.put("big", big)
        assert await store.get("big") == big
    async with Store({"tiers": [{"url": "memory://", "capacity": 64 * KIB}]}) as store:
        with pytest.raises(CapacityError):
            await store.put("big", b"y" * (256 * KIB))


async def test_delete_everywhere_and_no_resurrection_by_queued_write() -> None:
    backing = MemoryConnector()
    slow = ChaosLayer(backing, latency=0.05)
    async with Store(tiers("memory://", workers=1), connectors={1: slow}) as store:
        for i in range(5):
            await store.put("k", b"v%d" % i)
        assert await store.delete("k")
        await store.flush()
        assert await store.get("k") is None
        assert "k" not in backing.objects
        assert not await store.delete("k")


async def test_overwrites_land_in_order_with_many_workers() -> None:
    backing = MemoryConnector()
    jitter = ChaosLayer(backing, latency=0.01)
    async with Store(tiers("memory://", workers=8), connectors={1: jitter}) as store:
        for i in range(30):
            await store.put("k", b"v%02d" % i)
        await store.flush()
        assert store.l1 is not None
        store.l1.remove("k")
        assert await store.get("k") == b"v29"


async def test_concurrent_writers_and_readers_see_whole_versions() -> None:
    values = [bytes([i]) * (256 * KIB) for i in range(8)]
    async with Store(tiers(ns(), workers=4)) as store:

        async def writer(v: bytes) -> None:
            for _ in range(5):
                await store.put("k", v)

        async def reader() -> None:
            for _ in range(20):
                got = await store.get("k")
                assert got is None or got in values
                await asyncio.sleep(0)

        await asyncio.gather(*(writer(v) for v in values), *(reader() for _ in range(4)))
        await store.flush()
        assert await store.get("k") in values


async def test_returned_tensor_survives_eviction() -> None:
    cfg = {"tiers": [{"url": "memory://", "capacity": 8 * KIB}]}
    async with Store(cfg) as store:
        src = torch.arange(1024, dtype=torch.float32)  # 4 KiB
        await store.put("a", src)
        got = await store.get("a")
        assert isinstance(got, torch.Tensor)
        for i in range(10):  # churn: "a" is evicted but its memory is leased
            await store.put(f"n{i}", torch.zeros(1024, dtype=torch.float32))
        assert torch.equal(got, src)
        del got
        gc.collect()


async def test_prefetch_promotes_into_l1() -> None:
    url = ns()
    async with Store(tiers(url)) as store:
        for i in range(4):
            await store.put(f"k{i}", b"x")
        await store.flush()
        assert store.l1 is not None
        for i in range(4):
            store.l1.remove(f"k{i}")
        task = await store.prefetch([f"k{i}" for i in range(5)])
        assert await task == 4
        assert all(f"k{i}" in store.l1 for i in range(4))


async def test_restart_serves_disk_objects(tmp_path: Path) -> None:
    cfg = tiers(f"file://{tmp_path}/disk")
    src = torch.randn(3, 5, dtype=torch.float16)
    async with Store(cfg) as store:
        await store.put("k", src)
    async with Store(cfg) as store:
        got = await store.get("k")
        assert isinstance(got, torch.Tensor)
        assert torch.equal(got, src)


async def test_corrupt_disk_object_is_a_counted_miss(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    async with Store(tiers(f"file://{root}", l1=None)) as store:
        await store.put("k", b"a" * 10_000)
    files = [p for p in (root / "objects").rglob("*") if p.is_file()]
    assert len(files) == 1
    raw = bytearray(files[0].read_bytes())
    raw[-5] ^= 0xFF
    files[0].write_bytes(bytes(raw))
    async with Store(tiers(f"file://{root}", l1=None)) as store:
        assert await store.get("k") is None
        assert store.stats()["file"].corrupt == 1


async def test_closed_store_refuses() -> None:
    store = Store(tiers())
    async with store:
        pass
    from gateway import Unavailable

    with pytest.raises(Unavailable):
        await store.get("k")


def test_file_connector_importable() -> None:
    assert FileConnector.scheme == "file"


async def test_ttl_expires_in_every_tier() -> None:
    url = ns()
    async with Store(tiers(url)) as store:
        await store.put("short", b"x", ttl=0.05)
        await store.put("long", b"y", ttl=60)
        await store.flush()
        assert await store.get("short") == b"x"
        await asyncio.sleep(0.1)
        assert await store.get("short") is None  # expired in L1 and in the lower tier
        assert not await store.contains("short")
        assert await store.get("long") == b"y"
        assert store.l1 is not None
        store.l1.remove("long")
        assert await store.get("long") == b"y"  # promoted with its expiry
        assert store.l1.index["long"].expires_at is not None


async def test_slow_tier_is_a_timed_out_miss() -> None:
    backing = MemoryConnector.from_url(ns())
    slow = ChaosLayer(backing, latency=0.0)
    cfg = tiers("memory://", l1=None, timeout=0.2, retry={"attempts": 1})
    async with Store(cfg, connectors={0: slow}) as store:
        await store.put("k", b"v")
        await store.flush()
        slow.latency = 10.0
        loop = asyncio.get_running_loop()
        start = loop.time()
        assert await store.get("k") is None
        assert loop.time() - start < 5.0  # the 0.2 s timeout, not the 10 s backend; room for load
        assert store.stats()["memory"].errors.get("timeout") == 1
        slow.latency = 0.0
        assert await store.get("k") == b"v"


class SlowReply(Layer):
    """Reads from the real backend, then holds the reply back: a read that raced a delete."""

    delay = 0.0

    async def get(self, key: str) -> Buffer | None:
        data = await self.inner.get(key)
        await asyncio.sleep(self.delay)
        return data


async def test_delete_during_a_fetch_is_not_undone_by_promotion() -> None:
    slow = SlowReply(MemoryConnector.from_url(ns()))
    async with Store(tiers("memory://"), connectors={1: slow}) as store:
        await store.put("k", b"old")
        await store.flush()
        assert store.l1 is not None
        store.l1.remove("k")
        slow.delay = 0.2
        reader = asyncio.create_task(store.get("k"))
        await asyncio.sleep(0.05)  # the fetch has read the old bytes and is on its way back
        assert await store.delete("k")
        assert await reader == b"old"  # asked before the delete: it may see the old object
        assert "k" not in store.l1  # but that object is not promoted back into L1
        slow.delay = 0.0
        assert await store.get("k") is None


async def test_cancelled_put_leaks_no_memory() -> None:
    stalled = ChaosLayer(MemoryConnector(), latency=1.0)
    cfg = {
        "tiers": [
            {"url": "memory://", "capacity": 1 << 20},
            {"url": "memory://", "queue_size": 1, "workers": 1},
        ]
    }
    async with Store(cfg, connectors={1: stalled}) as store:
        assert store.pool is not None
        await store.put("a", b"x" * 1000)  # taken by the worker
        await store.put("b", b"x" * 1000)  # fills the queue
        blocked = asyncio.create_task(store.put("c", b"x" * 1000))
        await asyncio.sleep(0.05)
        blocked.cancel()
        with pytest.raises(asyncio.CancelledError):
            await blocked
        stalled.latency = 0.0
        await store.flush()
        for k in ("a", "b", "c"):
            await store.delete(k)
        gc.collect()
        assert store.pool.used == 0


async def test_stored_in_memory_answers_only_what_the_memory_tier_holds() -> None:
    lower = f"memory://{uuid.uuid4().hex}"
    config = {"tiers": [{"url": "memory://", "capacity": 16 << 20}, {"url": lower}]}
    store = Store(config)
    assert store.stored_in_memory("k") is None  # not open yet
    async with store:
        await store.put("k", b"held in memory")
        await store.flush()
        found = store.stored_in_memory("k")
        assert found is not None
        assert bytes(found.host()) == b"held in memory"
        assert found.meta == (await store.get_stored("k")).meta  # type: ignore[union-attr]
        assert store.stored_in_memory("absent") is None
    assert store.stored_in_memory("k") is None  # closed
    async with Store({"tiers": [{"url": lower}]}) as no_memory_tier:
        assert await no_memory_tier.get_stored("k") is not None  # the lower tier holds it
        assert no_memory_tier.stored_in_memory("k") is None


async def test_concurrent_puts_wait_for_each_others_copies_instead_of_failing() -> None:
    # 4 puts of 7 MiB into a 24 MiB memory-only store: each fits once the cache evicts, but
    # together their copies in progress hold more than the pool; none may fail for that.
    objs = [np.full(7 << 20, i, dtype=np.uint8) for i in range(8)]
    async with Store({"tiers": [{"url": "memory://", "capacity": 24 << 20}]}) as store:
        for rnd in range(12):
            puts = (store.put(f"r{rnd}-{j}", objs[(rnd + j) % 8]) for j in range(4))
            await asyncio.gather(*puts)


async def test_stat_reads_a_lower_tier_without_promoting_or_evicting() -> None:
    slow = ChaosLayer(MemoryConnector(), latency=0.05)  # concurrent stats overlap
    async with Store(tiers(ns(), l1=4 << 20), connectors={1: slow}) as store:
        await store.put("cold", np.zeros(3 << 20, dtype=np.uint8))
        await store.flush()
        assert store.l1 is not None
        assert store.pool is not None
        store.l1.remove("cold")
        await store.put("hot", b"h" * (2 << 20))  # with "cold" promoted, one would be evicted
        await store.flush()
        used = store.pool.used
        meta = await store.stat("cold")
        assert meta is not None
        assert meta.nbytes == 3 << 20
        assert "cold" not in store.l1
        assert "hot" in store.l1
        assert store.pool.used == used
        hot = await store.stat("hot")
        assert hot is not None
        assert hot.nbytes == 2 << 20
        assert await store.stat("missing") is None
        reads = store.stats()["memory1"].latency["get"].n
        metas = await asyncio.gather(*(store.stat("cold") for _ in range(10)))
        assert all(m is not None and m.nbytes == 3 << 20 for m in metas)
        assert store.stats()["memory1"].latency["get"].n - reads < 10  # shared, not one each
        assert "cold" not in store.l1
        assert store.pool.used == used


async def test_a_tier_whose_codec_or_scheme_is_unknown_is_a_config_error_naming_it(
    tmp_path: Path,
) -> None:
    codec = {"tiers": [{"url": f"file://{tmp_path}", "codec": "zstdd"}]}
    with pytest.raises(ConfigError, match="tier file: no codec named 'zstdd'"):
        async with Store(codec):
            pass
    with pytest.raises(ConfigError, match="tier nosuch: no connector"):
        async with Store({"tiers": [{"url": "nosuch://x"}]}):
            pass
