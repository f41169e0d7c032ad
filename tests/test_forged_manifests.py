"""Forged manifests under a main key cost a miss, never memory or time sized by their claims.

Anyone who can write to Redis, Valkey or memcached can write a manifest that names a huge
object, tiny parts or absurd part counts. Each test writes one straight into a real server with
a raw client (redis-py, aiomcache), then reads the key through a Store: the read is a miss
(counted as corrupt where the manifest breaks a limit), the process's peak resident memory does
not grow by the claimed size, the memory tier evicts nothing, the get ends within its tier
timeout and the event loop keeps running meanwhile.

Time on the loop is measured as the loop thread's CPU time, not wall time: on a busy 2-core
machine the OS can hold the whole process off the CPU for over a second, which is no fault of
the code under test, while work sized by a forged claim (zeroing, hashing, building part keys)
burns CPU on the loop thread.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiomcache
import pytest
import redis
from servers.redis import RedisNode

from connectors.memcached import MemcachedConnector
from connectors.memcached.config import MIN_PART_SIZE as MEMCACHED_MIN_PART
from connectors.memcached.connector import value_head
from connectors.redis import RedisConnector
from connectors.redis.config import MIN_PART_SIZE as REDIS_MIN_PART
from connectors.valkey import ValkeyConnector
from connectors.valkey.config import MIN_PART_SIZE as VALKEY_MIN_PART
from gateway import Store
from gateway.connector import BaseConnector, limiting_reads
from gateway.errors import CapacityError, CorruptObject
from gateway.parts import INLINE, MAX_PARTS, Manifest
from gateway.registry import connect
from gateway.testing import MiB, assert_same_bytes, make_bytes

GiB = 1 << 30
LIMIT = 256 * MiB  # the Store's max_object_size in these tests
TIMEOUT = 2.0  # the tier's timeout


@dataclass
class Backend:
    """A connector on a real server, and a raw client's way to write its main keys."""

    name: str
    url: str
    connector: BaseConnector
    part_size: int  # what the connector writes
    min_part_size: int  # the smallest its options allow
    plant: Callable[[str, bytes], Awaitable[None]]  # (store key, manifest) -> main value set


def _port(url: str) -> int:
    return int(url.rstrip("/").rpartition(":")[2].split("/")[0])


@pytest.fixture(params=["redis", "valkey", "memcached"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    namespace = f"forged-{uuid.uuid4().hex[:8]}:"
    if request.param == "redis":
        node: RedisNode = request.getfixturevalue("redis_server")
        conn = RedisConnector.from_url(node.url, namespace=namespace)
        raw = node.client()

        async def plant_redis(key: str, manifest: bytes) -> None:
            raw.set(conn.main_key(key), manifest)

        yield Backend("redis", node.url, conn, conn.options.part_size, REDIS_MIN_PART, plant_redis)
        await conn.close()
    elif request.param == "valkey":
        url: str = request.getfixturevalue("valkey_server")
        vconn = ValkeyConnector.from_url(url, namespace=namespace)
        vraw = redis.Redis(host="127.0.0.1", port=_port(url))

        async def plant_valkey(key: str, manifest: bytes) -> None:
            vraw.set(vconn.main_key(key), manifest)

        yield Backend("valkey", url, vconn, vconn.options.part_size, VALKEY_MIN_PART, plant_valkey)
        vraw.close()
        await vconn.close()
    else:
        murl: str = request.getfixturevalue("memcached_server")
        mconn = MemcachedConnector.from_url(murl, namespace=namespace)
        mraw = aiomcache.Client("127.0.0.1", _port(murl))

        async def plant_memcached(key: str, manifest: bytes) -> None:
            # A main value carries the key it belongs to, then the engine's value.
            await mraw.set(mconn.main_key(key), value_head(key.encode()) + manifest)

        yield Backend(
            "memcached", murl, mconn, mconn.part_size, MEMCACHED_MIN_PART, plant_memcached
        )
        await mraw.close()
        await mconn.close()


@pytest.fixture
async def store(backend: Backend) -> AsyncIterator[Store]:
    """A 16 MiB memory tier holding four objects, over the backend."""
    cfg: dict[str, Any] = {
        "tiers": [
            {"url": "memory://", "capacity": 16 * MiB},
            {"url": f"{backend.name}://", "name": "below", "timeout": TIMEOUT},
        ],
        "max_object_size": LIMIT,
    }
    async with Store(cfg, connectors={1: backend.connector}) as opened:
        for i in range(4):
            await opened.put(f"resident{i}", make_bytes(MiB, i))
        await opened.flush()
        yield opened


def _status_mib(field: str) -> float:
    found = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    assert found is not None, f"no {field} in /proc/self/status"
    return int(found.group(1)) / 1024


def _reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM restarts from the resident size


@dataclass
class GetReport:
    found: object
    rss_growth_mib: float  # peak resident memory during the get, over the start
    max_stall: float  # most CPU the loop thread spent between two runs of a ticker


async def observed_get(store: Store, key: str) -> GetReport:
    """``store.get(key)`` under watch: peak RSS growth, and the loop's longest stall (in CPU
    seconds of the loop thread, so that the OS descheduling the process does not count)."""
    stall = 0.0
    running = True

    async def tick() -> None:
        nonlocal stall
        last = time.thread_time()
        while running:
            await asyncio.sleep(0.005)
            now = time.thread_time()
            stall = max(stall, now - last)
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.02)
    _reset_peak_rss()
    start = _status_mib("VmRSS")
    try:
        async with asyncio.timeout(30):  # far beyond anything acceptable: no hang
            found = await store.get(key)
    finally:
        running = False
        await ticker
    return GetReport(found, _status_mib("VmHWM") - start, stall)


def manifest(total: int, part_size: int) -> bytes:
    return Manifest(os.urandom(16), total, part_size, -(-total // part_size)).encode()


def assert_quick_miss(report: GetReport, store: Store, *, corrupt: int) -> None:
    stats = store.stats()
    assert report.found is None
    assert stats["below"].corrupt == corrupt
    assert stats["below"].errors == ({"corrupt": corrupt} if corrupt else {})  # no timeout
    assert report.max_stall < 1.0
    assert report.rss_growth_mib < 64
    assert stats["memory"].evictions == 0
    assert store.l1 is not None
    assert sorted(store.l1.index) == [f"resident{i}" for i in range(4)]


async def test_manifest_over_max_object_size_is_corrupt_and_allocates_nothing(
    backend: Backend, store: Store
) -> None:
    await backend.plant("forged", manifest(GiB, backend.part_size))
    report = await observed_get(store, "forged")
    assert_quick_miss(report, store, corrupt=1)


async def test_tier_never_asks_for_the_claimed_size(backend: Backend, store: Store) -> None:
    asked: list[int] = []

    def alloc(n: int) -> None:
        asked.append(n)

    await backend.plant("forged", manifest(GiB, backend.part_size))
    assert await store.tiers[0].read("forged", alloc, LIMIT) is None
    assert store.tiers[0].stats.corrupt == 1
    assert all(n <= 2 * LIMIT for n in asked)


async def test_manifest_within_limits_whose_parts_are_missing_is_a_quick_miss(
    backend: Backend, store: Store
) -> None:
    # As large as the store accepts, and larger than the memory tier: nothing is evicted,
    # and memory is taken only for parts that arrive (none do).
    await backend.plant("forged", manifest(LIMIT, backend.part_size))
    report = await observed_get(store, "forged")
    assert_quick_miss(report, store, corrupt=0)


async def test_most_parts_at_the_smallest_size_end_at_the_first_missing_one(
    backend: Backend, store: Store
) -> None:
    count = min(MAX_PARTS, LIMIT // backend.min_part_size)
    await backend.plant("forged", manifest(count * backend.min_part_size, backend.min_part_size))
    report = await observed_get(store, "forged")
    assert_quick_miss(report, store, corrupt=0)


@pytest.mark.parametrize(
    ("what", "parts"),
    [
        ("131072 parts of 8 bytes", lambda smallest: (131072 * 8, 8)),
        ("parts under the smallest size", lambda smallest: (1000 * (smallest - 1), smallest - 1)),
        ("more parts than ever written", lambda smallest: ((MAX_PARTS + 1) * 1024, 1024)),
    ],
)
async def test_manifest_of_impossible_parts_is_corrupt_and_quick(
    backend: Backend, store: Store, what: str, parts: Callable[[int], tuple[int, int]]
) -> None:
    total, part_size = parts(backend.min_part_size)
    await backend.plant("forged", manifest(total, part_size))
    report = await observed_get(store, "forged")
    assert_quick_miss(report, store, corrupt=1)


async def test_count_that_disagrees_with_the_sizes_is_corrupt(
    backend: Backend, store: Store
) -> None:
    forged = Manifest(os.urandom(16), 8 * MiB, backend.part_size, 1 << 31).encode()
    await backend.plant("forged", forged)
    report = await observed_get(store, "forged")
    assert_quick_miss(report, store, corrupt=1)


async def test_overwriting_a_manifest_of_absurd_count_touches_none_of_its_parts(
    backend: Backend,
) -> None:
    """A put replaces the value and removes the parts the old manifest names: a forged one
    naming millions of parts is left alone instead (nothing of ours to clean up)."""
    forged = Manifest(os.urandom(16), 1 << 22, 1, 1 << 22).encode()
    await backend.plant("forged", forged)
    started = time.thread_time()  # CPU of the loop thread: the OS's pauses do not count
    async with asyncio.timeout(30):
        await backend.connector.put("forged", b"ours now")
    assert time.thread_time() - started < 1.0  # building 4 million part keys took seconds
    got = await backend.connector.get("forged")
    assert got is not None
    assert bytes(got) == b"ours now"


async def test_many_parts_are_read_by_a_bounded_number_of_tasks(
    backend: Backend, tmp_path: Path
) -> None:
    """A real object of 512 parts: its get runs a few workers, not a task per part."""
    options: dict[str, Any] = {"part_size": backend.min_part_size, "inline_max": 0}
    if backend.name == "memcached":
        options["item_limit"] = "64MiB"
    conn = connect(backend.url, namespace=f"many-{uuid.uuid4().hex[:8]}:", **options)
    data = make_bytes(512 * backend.min_part_size, 9)
    most_tasks = 0
    running = True

    async def count_tasks() -> None:
        nonlocal most_tasks
        while running:
            most_tasks = max(most_tasks, len(asyncio.all_tasks()))
            await asyncio.sleep(0.001)

    try:
        await conn.put("many", data)
        counter = asyncio.create_task(count_tasks())
        got = await conn.get("many")
        running = False
        await counter
    finally:
        await conn.close()
    assert_same_bytes(got, data)
    assert most_tasks < 64


async def test_object_needing_more_parts_than_a_manifest_may_name_is_refused(
    redis_server: RedisNode,
) -> None:
    """Readers refuse manifests of more than MAX_PARTS parts, so writers never make one."""
    namespace = f"refused-{uuid.uuid4().hex[:8]}:"
    conn = RedisConnector.from_url(redis_server.url, namespace=namespace, part_size=REDIS_MIN_PART)
    try:
        with pytest.raises(CapacityError, match="raise part_size"):
            await conn.put("huge", bytes(MAX_PARTS * REDIS_MIN_PART + 1))
        assert not await conn.exists("huge")
    finally:
        await conn.close()
    assert redis_server.client().keys(f"{namespace}*") == []  # not a single part written


async def test_an_inline_value_over_the_limit_is_corrupt_and_never_allocated(
    backend: Backend,
) -> None:
    """Not a manifest but an inline value longer than the reader takes: refused as corrupt
    before the reader's allocator is asked for it."""
    asked: list[int] = []

    def alloc(n: int) -> None:
        asked.append(n)

    await backend.plant("big-inline", bytes([INLINE]) + bytes(4 * MiB))
    with limiting_reads(MiB), pytest.raises(CorruptObject):
        await backend.connector.get_into("big-inline", alloc)
    assert all(n <= MiB for n in asked), asked
