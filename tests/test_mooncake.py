"""mooncake:// behaviour beyond the conformance suite, on real Mooncake clusters.

Each cluster is a ``mooncake_master`` plus a separate ``mooncake_client`` process holding the
memory segment (``tests/servers/mooncake.py``); the connectors contribute none, so their data
crosses TCP to another process. RDMA cannot be tested here (no RDMA device): TCP only.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
import urllib.request
import uuid

import numpy as np
import pytest
from servers.mooncake import LEASE_TTL_MS, MooncakeCluster
from servers.proc import free_port

from connectors.mooncake import MooncakeConnector
from gateway.errors import CapacityError, ConfigError, CorruptObject, Timeout, Unavailable
from gateway.testing import assert_same_bytes, make_bytes

MiB = 1 << 20


def connect(cluster: MooncakeCluster, **options: object) -> MooncakeConnector:
    return MooncakeConnector.from_url(cluster.url, **{**cluster.options, **options})


def segment_bytes(cluster: MooncakeCluster) -> dict[str, int]:
    """Allocated bytes per mounted segment, from the master's metrics."""
    url = f"http://127.0.0.1:{cluster.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    found = re.findall(r'^segment_allocated_bytes\{segment="([^"]+)"\} (\d+)', text, re.M)
    return {name: int(value) for name, value in found}


@pytest.fixture
def prefix() -> str:
    return f"kvgate-test-{uuid.uuid4().hex[:12]}/"


async def test_objects_live_in_the_holders_segment(
    mooncake_cluster: MooncakeCluster, prefix: str
) -> None:
    before = segment_bytes(mooncake_cluster)
    assert len(before) == 1, "only the holder process contributes a segment"
    data = make_bytes(8 * MiB, seed=1)
    async with connect(mooncake_cluster) as conn:
        await conn.put(f"{prefix}a", data)
        after = segment_bytes(mooncake_cluster)
        assert after.keys() == before.keys()  # the connector mounted no segment of its own
        (name,) = after
        assert after[name] - before[name] >= len(data)
        assert_same_bytes(await conn.get(f"{prefix}a"), data)
        assert await conn.delete(f"{prefix}a")


async def test_a_miss_is_none_and_an_empty_object_is_not(
    mooncake_cluster: MooncakeCluster, prefix: str
) -> None:
    calls: list[int] = []

    def alloc(n: int) -> memoryview:
        calls.append(n)
        return memoryview(bytearray(n))

    async with connect(mooncake_cluster) as conn:
        assert await conn.get(f"{prefix}never") is None
        assert await conn.get_into(f"{prefix}never", alloc) is None
        assert calls == []
        assert not await conn.exists(f"{prefix}never")

        await conn.put(f"{prefix}empty", b"")
        got = await conn.get(f"{prefix}empty")
        assert got is not None
        assert bytes(got) == b""
        into = await conn.get_into(f"{prefix}empty", alloc)
        assert into is not None
        assert into.nbytes == 0
        assert calls == [0]
        assert await conn.exists(f"{prefix}empty")
        # Payloads that look like the connector's own trailer round-trip as they are.
        for i, value in enumerate([b"\x00", b"KVG\x04", b"\x00KVG\x05", b"x" * 3 + b"KVG\x04"]):
            await conn.put(f"{prefix}odd{i}", value)
            got = await conn.get(f"{prefix}odd{i}")
            assert got is not None
            assert bytes(got) == value


async def test_same_size_overwrites_never_tear_other_clients_reads(
    mooncake_cluster: MooncakeCluster, prefix: str
) -> None:
    """Mooncake rewrites a same-size value in place under its readers; the connector's
    overwrites never do (``connectors.mooncake.blob``). The reader is another client, as in
    another process: it may see the key briefly missing while it is replaced, never a mix."""
    key = f"{prefix}contended"
    size = 2 * MiB
    values = [bytes([v]) * size for v in (0x11, 0x22)]
    async with connect(mooncake_cluster) as writer, connect(mooncake_cluster) as reader:
        await writer.put(key, values[0])
        done = asyncio.Event()
        seen: dict[str, int] = {}

        async def read() -> None:
            buf = np.empty(size, dtype=np.uint8)
            while not done.is_set():
                got = await reader.get_into(key, lambda n: buf.data if n == size else None)
                if got is None:
                    name = "miss"
                else:
                    distinct = np.unique(np.frombuffer(got, dtype=np.uint8)[::4096])
                    name = "torn" if len(distinct) > 1 else hex(int(distinct[0]))
                seen[name] = seen.get(name, 0) + 1

        readers = [asyncio.create_task(read()) for _ in range(2)]
        try:
            start = time.monotonic()
            writes = 0

            def good_reads() -> int:
                return seen.get("0x11", 0) + seen.get("0x22", 0)

            # Two seconds of overwrites, longer on a busy machine until readers got through.
            while time.monotonic() - start < (2.0 if good_reads() >= 10 else 10.0):
                writes += 1
                await writer.put(key, values[writes % 2])
        finally:
            done.set()
            await asyncio.gather(*readers)
        assert "torn" not in seen, seen
        assert good_reads() >= 10, seen
        assert writes > 10


async def test_reads_in_one_connector_never_miss_during_its_overwrites(
    mooncake_cluster: MooncakeCluster, prefix: str
) -> None:
    key = f"{prefix}contended"
    size = MiB
    values = [bytes([v]) * size for v in (0x11, 0x22)]
    async with connect(mooncake_cluster) as conn:
        await conn.put(key, values[0])
        done = asyncio.Event()
        reads = 0

        async def read() -> None:
            nonlocal reads
            while not done.is_set():
                got = await conn.get(key)
                assert got is not None, "a reader missed a key that was always there"
                assert bytes(got) in values
                reads += 1

        readers = [asyncio.create_task(read()) for _ in range(2)]
        try:
            for i in range(40):
                await conn.put(key, values[i % 2])
        finally:
            done.set()
            await asyncio.gather(*readers)
        assert reads > 10


async def test_a_foreign_value_is_corrupt_not_misread(
    mooncake_cluster: MooncakeCluster, prefix: str
) -> None:
    from mooncake.store import MooncakeDistributedStore

    async with connect(mooncake_cluster) as conn:
        mkey = conn.key_for(f"{prefix}foreign")
        raw = MooncakeDistributedStore()
        rc = raw.setup(
            "127.0.0.1",
            mooncake_cluster.options["metadata_server"],
            0,
            16 * MiB,
            "tcp",
            "",
            f"127.0.0.1:{mooncake_cluster.rpc_port}",
        )
        assert rc == 0
        try:
            assert raw.put(mkey, b"written by someone else") == 0
        finally:
            await asyncio.to_thread(raw.close)
        with pytest.raises(CorruptObject):
            await conn.get(f"{prefix}foreign")
        assert await conn.exists(f"{prefix}foreign")


async def test_delete_waits_for_a_readers_lease(
    mooncake_cluster: MooncakeCluster, prefix: str
) -> None:
    async with connect(mooncake_cluster) as conn:
        await conn.put(f"{prefix}leased", b"data")
        assert await conn.exists(f"{prefix}leased")  # takes a lease (2 s on this master)
        start = time.monotonic()
        assert await conn.delete(f"{prefix}leased") is True
        assert time.monotonic() - start > 0.3, "the lease was not waited for"
        assert not await conn.exists(f"{prefix}leased")
        assert await conn.delete(f"{prefix}leased") is False

    async with connect(mooncake_cluster, timeout=0.3) as short:
        await short.put(f"{prefix}leased2", b"data")
        assert await short.get(f"{prefix}leased2") == b"data"
        with pytest.raises(Timeout, match="OBJECT_HAS_LEASE"):
            await short.delete(f"{prefix}leased2")  # a refused remove is not a success
        await asyncio.sleep(LEASE_TTL_MS / 1000)
        assert await short.delete(f"{prefix}leased2") is True


async def test_a_corrupt_object_is_removed_at_once_despite_the_readers_lease(
    mooncake_cluster: MooncakeCluster, prefix: str
) -> None:
    """The get that finds the bytes corrupt took a lease on them; its discard does not wait
    for it (which stalled the get for the tier's timeout and counted an outage)."""
    from gateway import Store

    key = f"{prefix}tampered"
    tier = {"url": mooncake_cluster.url, "options": mooncake_cluster.options, "timeout": 5.0}
    async with Store({"tiers": [tier], "staging": 16 * MiB}) as store:
        await store.put(key, make_bytes(MiB), durable=True)
        conn = store.tiers[0].connector
        frame = bytearray(await conn.get(key) or b"")
        frame[len(frame) // 2] ^= 0x10
        await conn.put(key, bytes(frame))
        start = time.monotonic()
        assert await store.get(key) is None
        assert time.monotonic() - start < LEASE_TTL_MS / 1000 / 2
        stats = store.stats()["mooncake"]
        assert (stats.corrupt, dict(stats.errors)) == (1, {})
        assert not await conn.exists(key)


async def test_an_object_over_the_staging_memory_is_a_capacity_error(
    mooncake_cluster: MooncakeCluster, prefix: str
) -> None:
    async with connect(mooncake_cluster, local_buffer_size=4 * MiB) as conn:
        limit = conn.capabilities.max_object_size
        assert limit is not None
        assert 3 * MiB < limit < 4 * MiB
        with pytest.raises(CapacityError, match="local_buffer_size"):
            await conn.put(f"{prefix}big", [b"x" * (2 * MiB), b"y" * (2 * MiB)])
        data = make_bytes(limit, seed=3)
        await conn.put(f"{prefix}fits", data)
        assert_same_bytes(await conn.get(f"{prefix}fits"), data)


async def test_a_full_store_is_a_capacity_error(mooncake_factory, prefix: str) -> None:  # type: ignore[no-untyped-def]
    cluster: MooncakeCluster = mooncake_factory(segment_size=64 * MiB)
    async with connect(cluster, local_buffer_size=256 * MiB) as conn:
        # Fill the segment with objects that readers hold leases on: nothing can be evicted.
        # (A put that does not fit asks the master to evict, and its eviction thread may run
        # a while later: the fill goes first, so that no such request is pending while an
        # object is still without a lease. CI once saw fill/0 evicted the other way round.)
        keys = [f"{prefix}fill/{i}" for i in range(6)]
        for key in keys:
            await conn.put(key, b"f" * (8 * MiB))
        assert await conn.exists_many(keys) == [True] * len(keys)  # leases for 2 s
        with pytest.raises(CapacityError, match="full"):
            await conn.put(f"{prefix}larger-than-the-segment", b"z" * (96 * MiB))
        assert await conn.exists_many(keys) == [True] * len(keys)  # nothing evicted; renewed
        with pytest.raises(CapacityError, match="full"):
            await conn.put(f"{prefix}one-too-many", b"o" * (24 * MiB))
        # The store is usable again for what fits.
        await conn.put(f"{prefix}small", b"s")
        assert await conn.get(f"{prefix}small") == b"s"


async def test_an_unreachable_metadata_server_is_unavailable(
    mooncake_cluster: MooncakeCluster,
) -> None:
    dead = f"http://127.0.0.1:{free_port()}/metadata"
    conn = connect(mooncake_cluster, metadata_server=dead, timeout=20.0)
    start = time.monotonic()
    try:
        with pytest.raises(Unavailable, match="setup"):
            await conn.get("anything")
        assert time.monotonic() - start < 15
    finally:
        await conn.close()


@pytest.mark.parametrize(
    ("url", "options", "message"),
    [
        ("mooncake://127.0.0.1:1", {"capacity": 10}, "capacity"),
        ("mooncake://127.0.0.1:1", {"protocol": "rdma"}, "device_name"),
        ("mooncake://127.0.0.1:1", {"device_name": "mlx5_0"}, "rdma"),
        ("mooncake://127.0.0.1:1", {"protocol": "udp"}, "protocol"),
        ("mooncake://127.0.0.1:1/path", {}, "no path"),
        ("mooncake://user:pw@127.0.0.1:1", {}, "credentials"),
        ("mooncake://127.0.0.1:1?timeout=1", {}, "keyword arguments"),
        ("redis://127.0.0.1:1", {}, "not a mooncake"),
        ("mooncake://:1", {}, "no master host"),
    ],
)
def test_bad_urls_and_options_are_config_errors(
    url: str, options: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        MooncakeConnector.from_url(url, **options)
    assert "pw" not in str(info.value)


def test_defaults() -> None:
    conn = MooncakeConnector.from_url("mooncake://master.example")
    assert conn.target.master == "master.example:50051"
    assert conn.target.metadata_server == "http://master.example:8080/metadata"
    assert conn.capabilities.zero_copy
    assert not conn.capabilities.list
    assert conn.capabilities.persistent  # it contributes no segment: objects outlive it
    assert not MooncakeConnector.from_url(
        "mooncake://m", global_segment_size=MiB
    ).capabilities.persistent


async def test_keys_map_to_distinct_bounded_mooncake_keys() -> None:
    conn = MooncakeConnector.from_url("mooncake://m", namespace="ns/")
    keys = ["a", "A", "a/b", "a%2Fb", "nul\x00byte", "k" * 1000, "\udc80 lone surrogate"]
    names = {conn.key_for(k) for k in keys}
    assert len(names) == len(keys)
    assert all(n.startswith("ns/") and len(n) == 43 and n.isascii() for n in names)
    await conn.close()


async def test_raw_client_baseline(mooncake_cluster: MooncakeCluster) -> None:
    put, get = await MooncakeConnector.raw_client_baseline(
        mooncake_cluster.url,
        mooncake_cluster.options,
        size=MiB,
        count=4,
        concurrency=2,
        payloads=[bytes([i]) * MiB for i in range(3)],
    )
    assert put > 0
    assert get > 0


async def test_a_connector_works_from_many_tasks_at_once(
    mooncake_cluster: MooncakeCluster, prefix: str
) -> None:
    items = {f"{prefix}many/{i}": os.urandom(i * 997) for i in range(24)}
    async with connect(mooncake_cluster, threads=3, local_buffer_size=8 * MiB) as conn:
        await asyncio.gather(*(conn.put(k, v) for k, v in items.items()))
        got = await asyncio.gather(*(conn.get(k) for k in items))
        assert [bytes(g) if g is not None else None for g in got] == list(items.values())
        assert await conn.get_many(list(items)) == list(items.values())


async def test_calls_past_their_deadline_end_at_once_and_give_back_staging(
    mooncake_cluster: MooncakeCluster, prefix: str
) -> None:
    big = make_bytes(48 * MiB, seed=5)
    async with connect(mooncake_cluster, timeout=0.05) as hasty:
        start = time.monotonic()
        with pytest.raises(Timeout):
            await hasty.put(f"{prefix}hasty", big)  # 48 MiB do not cross TCP in 50 ms
        assert time.monotonic() - start < 3.0

    async with connect(mooncake_cluster, local_buffer_size=64 * MiB) as conn:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(conn.put(f"{prefix}cancelled", big), 0.01)
        # Two 48 MiB blocks do not fit in 64 MiB of staging: this put waits for the cancelled
        # one's thread to give its block back, then goes through.
        await conn.put(f"{prefix}after", big)
        assert_same_bytes(await conn.get(f"{prefix}after"), big)
