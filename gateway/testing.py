"""The connector conformance suite: the behaviour every connector must have, on a real backend.

A connector joins with a short runner file that subclasses ``ConnectorConformance`` and
provides one fixture, ``connector_factory``: an async callable that returns a NEW connector
instance on the same backend and namespace each time it is called::

    class TestRedisConformance(ConnectorConformance):
        @pytest.fixture
        def connector_factory(self, redis_server: str) -> ConnectorFactory:
            async def make() -> Connector:
                return RedisConnector.from_url(redis_server)
            return make

The suite closes every instance it opens and never holds two at once, so backends that lock
their namespace (``file://``) work. Tests skip by capabilities, never by connector name:
``stores_data=False`` turns the round trips into "accepted, then a miss"; ``persistent`` adds
"a new instance sees what the closed one wrote"; ``list`` adds the listing tests;
``max_object_size`` and ``max_key_length`` skip what the connector declares it cannot hold.

Keys carry a random per-test prefix (the odd-key test also uses bare odd keys and deletes them),
so a backend that is not empty at the start still works. Data comes from numpy and is checked
with numpy and hashlib only; a failure reports lengths, the first differing offset and digests,
never a 256 MiB diff.
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import numpy as np
import pytest
import pytest_asyncio

from gateway.connector import Connector
from gateway.errors import Unsupported
from gateway.layers import Layer
from gateway.store import Store
from gateway.types import Buffer, Capabilities, ObjectInfo

ConnectorFactory = Callable[[], Awaitable[Connector]]
STORE_DTYPES = (
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "int8",
    "uint8",
    "int16",
    "int32",
    "int64",
    "bool",
    "float8_e4m3fn",
    "float8_e5m2",
)
"""Returns a new connector instance on the backend and namespace the runner set up."""

KiB = 1 << 10
MiB = 1 << 20
ROUND_TRIP_SIZES = (0, 1, 4 * KiB, MiB, 32 * MiB, 256 * MiB)

# Keys that break naive key -> path/name mappings: traversal, separators, escapes that collide
# with what they escape, case folding, control characters, non-ASCII, LMCache's key format, and
# length.
ODD_KEYS = (
    "../../etc/passwd",
    "/abs/path",
    "a/b",
    "a%2Fb",
    "a_b",
    "a\\b",
    "A/B",
    "..",
    ".",
    " ",
    "key with spaces",
    "tab\tnew\nline",
    "nul\x00byte",
    "ünïcødé-键-🔑",
    "model@1@0@-1a2b@bfloat16@k%v",
    "model@1@0@-1a2b@bfloat16@k%V",
    "k" * 1000,
)


def make_bytes(size: int, seed: int = 0) -> bytes:
    """``size`` pseudo-random bytes, cheap even for hundreds of MiB.

    One random MiB is tiled, and each MiB gets its index in its first 8 bytes so that a block
    stored out of place still shows.
    """
    rng = np.random.default_rng(seed)
    block = rng.integers(0, 256, min(size, MiB), dtype=np.uint8)
    if size <= MiB:
        return block.tobytes()
    n_blocks = -(-size // MiB)
    tiled = np.tile(block, n_blocks).reshape(n_blocks, MiB)
    tiled[:, :8] = np.arange(n_blocks, dtype="<u8").view(np.uint8).reshape(n_blocks, 8)
    return tiled.reshape(-1)[:size].tobytes()


def digest(data: Buffer) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def assert_same_bytes(got: Buffer | None, want: Buffer, what: str = "object") -> None:
    """``got`` holds exactly the bytes of ``want``; a failure says where, without a diff."""
    assert got is not None, f"{what}: a miss, expected {len(want)} bytes"
    g = np.frombuffer(memoryview(got).cast("B"), np.uint8)
    w = np.frombuffer(memoryview(want).cast("B"), np.uint8)
    if g.size != w.size:
        pytest.fail(f"{what}: {g.size} bytes, expected {w.size}")
    if not np.array_equal(g, w):
        first = int(np.flatnonzero(g != w)[0])
        pytest.fail(
            f"{what}: bytes differ from offset {first}; blake2b {digest(got)} != {digest(want)}"
        )


async def listed(conn: Connector, prefix: str) -> dict[str, int]:
    out: dict[str, int] = {}
    async for info in conn.list(prefix):
        assert isinstance(info, ObjectInfo)
        assert info.key.startswith(prefix)
        out[info.key] = info.size
    return out


def _need_data(caps: Capabilities) -> None:
    if not caps.stores_data:
        pytest.skip("the connector does not store data (stores_data=False)")


def _need_size(caps: Capabilities, size: int) -> None:
    if caps.max_object_size is not None and size > caps.max_object_size:
        pytest.skip(f"{size} bytes is over the connector's max_object_size")


class ConnectorConformance:
    """Subclass as ``Test<Name>Conformance`` and provide ``connector_factory``."""

    pytestmark = pytest.mark.asyncio

    @pytest.fixture
    def connector_factory(self) -> ConnectorFactory:
        raise NotImplementedError("the runner must provide a connector_factory fixture")

    @pytest_asyncio.fixture
    async def connector(self, connector_factory: ConnectorFactory) -> AsyncIterator[Connector]:
        conn = await connector_factory()
        try:
            yield conn
        finally:
            await conn.close()

    @pytest.fixture
    def prefix(self) -> str:
        return f"kvgate-conformance-{uuid.uuid4().hex[:12]}/"

    # -- the contract's shape -------------------------------------------------------------

    async def test_is_a_connector(self, connector: Connector) -> None:
        assert isinstance(connector, Connector)
        assert isinstance(connector.capabilities, Capabilities)
        assert isinstance(connector.scheme, str)
        assert connector.scheme
        used, capacity = connector.usage()
        assert used >= 0
        assert capacity is None or capacity > 0

    async def test_ping(self, connector: Connector) -> None:
        assert await connector.ping() is True

    async def test_close_twice_is_harmless(self, connector_factory: ConnectorFactory) -> None:
        conn = await connector_factory()
        await conn.close()
        await conn.close()

    # -- round trips ----------------------------------------------------------------------

    @pytest.mark.parametrize(
        "size", ROUND_TRIP_SIZES, ids=["0B", "1B", "4KiB", "1MiB", "32MiB", "256MiB"]
    )
    async def test_round_trip(self, connector: Connector, prefix: str, size: int) -> None:
        caps = connector.capabilities
        _need_data(caps)
        _need_size(caps, size)
        key = f"{prefix}round-trip"
        data = make_bytes(size, seed=size)
        await connector.put(key, data)
        try:
            assert await connector.exists(key)
            assert_same_bytes(await connector.get(key), data, f"{size}-byte object")
        finally:
            await connector.delete(key)  # frees a 256 MiB object before the next test

    async def test_discarding_connector_accepts_and_misses(
        self, connector: Connector, prefix: str
    ) -> None:
        if connector.capabilities.stores_data:
            pytest.skip("the connector stores data: the round-trip tests cover it")
        key = f"{prefix}discarded"
        await connector.put(key, make_bytes(4 * KiB))
        await connector.put_many([(key, b"x"), (f"{prefix}other", [b"a", b"b"])])
        assert await connector.get(key) is None
        assert await connector.get_many([key]) == [None]
        assert not await connector.exists(key)
        assert await connector.exists_many([key]) == [False]
        assert await connector.get_into(key, lambda n: memoryview(bytearray(n))) is None
        assert await connector.delete(key) is False

    async def test_scatter_list_equals_joined_bytes(
        self, connector: Connector, prefix: str
    ) -> None:
        _need_data(connector.capabilities)
        mutable = bytearray(make_bytes(10_000, seed=1))
        floats = np.arange(1000, dtype=np.float32)
        parts: list[Buffer] = [
            b"head",
            mutable,
            b"",
            memoryview(make_bytes(MiB + 7, seed=2)),
            floats.data,  # a non-byte format: the bytes count, not the items
            # Many small parts: more than one writev (IOV_MAX) worth.
            *(make_bytes(i % 7, seed=i) for i in range(1500)),
        ]
        want = b"".join(memoryview(p).cast("B") for p in parts)
        key = f"{prefix}scatter"
        await connector.put(key, parts)
        mutable[:] = b"\xff" * len(mutable)  # the connector must not keep the caller's buffer
        assert_same_bytes(await connector.get(key), want, "scatter-list object")

    async def test_overwrite(self, connector: Connector, prefix: str) -> None:
        _need_data(connector.capabilities)
        key = f"{prefix}overwrite"
        for i, size in enumerate((MiB + 3, 10, 0, 4 * KiB + 1)):
            data = make_bytes(size, seed=100 + i)
            await connector.put(key, data)
            assert_same_bytes(await connector.get(key), data, f"value {i} ({size} bytes)")
        if connector.capabilities.list:
            assert await listed(connector, key) == {key: 4 * KiB + 1}

    async def test_delete(self, connector: Connector, prefix: str) -> None:
        _need_data(connector.capabilities)
        key = f"{prefix}delete"
        await connector.put(key, b"to be deleted")
        assert await connector.delete(key) is True
        assert await connector.delete(key) is False
        assert await connector.get(key) is None
        assert not await connector.exists(key)
        assert await connector.get_into(key, lambda n: memoryview(bytearray(n))) is None

    async def test_exists(self, connector: Connector, prefix: str) -> None:
        _need_data(connector.capabilities)
        key = f"{prefix}exists"
        assert not await connector.exists(key)
        await connector.put(key, b"")
        assert await connector.exists(key)

    async def test_unknown_key_is_a_miss(self, connector: Connector, prefix: str) -> None:
        key = f"{prefix}never-written"
        assert await connector.get(key) is None
        assert not await connector.exists(key)
        assert await connector.delete(key) is False
        assert await connector.get_many([key, key]) == [None, None]
        assert await connector.get_into(key, lambda n: memoryview(bytearray(n))) is None

    async def test_odd_keys_round_trip_without_collisions(
        self, connector: Connector, prefix: str
    ) -> None:
        caps = connector.capabilities
        _need_data(caps)
        limit = caps.max_key_length
        bare = [k for k in ODD_KEYS if limit is None or len(k.encode()) <= limit]
        prefixed = [
            prefix + k for k in bare if limit is None or len((prefix + k).encode()) <= limit
        ]
        keys = bare + prefixed
        values = {k: f"value {i} of {k!r}".encode() for i, k in enumerate(keys)}
        try:
            for key, value in values.items():
                await connector.put(key, value)
            for key, value in values.items():
                assert_same_bytes(await connector.get(key), value, f"key {key!r}")
                assert await connector.exists(key)
            if caps.list:
                found = await listed(connector, prefix)
                assert found == {k: len(values[k]) for k in prefixed}
        finally:
            for key in bare:  # bare keys live outside this test's prefix: clean them up
                await connector.delete(key)

    async def test_batch_forms_agree_with_single_calls(
        self, connector: Connector, prefix: str
    ) -> None:
        _need_data(connector.capabilities)
        items = [(f"{prefix}batch/{i}", make_bytes(i * 1000, seed=i)) for i in range(6)]
        keys = [k for k, _ in items] + [f"{prefix}batch/missing"]
        await connector.put_many(items)
        many = await connector.get_many(keys)
        assert len(many) == len(keys)
        for (key, data), got in zip(items, many, strict=False):
            assert_same_bytes(got, data, f"get_many {key!r}")
            assert_same_bytes(await connector.get(key), data, f"get {key!r}")
        assert many[-1] is None
        assert await connector.exists_many(keys) == [await connector.exists(k) for k in keys]
        assert await connector.exists_many(keys) == [True] * len(items) + [False]
        assert await connector.exists_many([]) == []
        assert await connector.get_many([]) == []
        # put_many of scatter lists, overwriting what is there.
        await connector.put_many([(keys[0], [b"ab", bytearray(b"cd")]), (keys[1], b"")])
        assert await connector.get_many(keys[:2]) == [b"abcd", b""]

    async def test_exists_many_answers_each_key_in_order(
        self, connector: Connector, prefix: str
    ) -> None:
        """A batch like a prefix lookup's: hundreds of keys, present and absent interleaved,
        repeated keys, odd keys; each answer in its key's place."""
        _need_data(connector.capabilities)
        limit = connector.capabilities.max_key_length
        odd = [
            f"{prefix}{k}"
            for k in ODD_KEYS
            if limit is None or len(f"{prefix}{k}".encode()) <= limit
        ]
        keys = [f"{prefix}many/{i}" for i in range(300)] + odd
        stored = {k for i, k in enumerate(keys) if i % 3 != 1}  # present, absent, present, ...
        for key in sorted(stored):
            await connector.put(key, b"v")
        asked = [*keys, keys[0], keys[1], keys[0]]  # duplicates answer like the first time
        want = [k in stored for k in asked]
        assert await connector.exists_many(asked) == want
        assert await connector.exists_many(asked[::-1]) == want[::-1]
        assert await connector.exists_many([keys[1]]) == [False]
        assert await connector.exists_many([keys[0]]) == [True]

    @pytest.mark.parametrize("size", [0, 5, MiB + 3])
    async def test_get_into(self, connector: Connector, prefix: str, size: int) -> None:
        _need_data(connector.capabilities)
        key = f"{prefix}get-into"
        data = make_bytes(size, seed=7)
        await connector.put(key, data)

        slabs: list[bytearray] = []

        def alloc(n: int) -> memoryview:
            slabs.append(bytearray(n))
            return memoryview(slabs[-1])

        got = await connector.get_into(key, alloc)
        assert [len(s) for s in slabs] == [size]
        assert_same_bytes(got, data, "get_into with a buffer")
        assert_same_bytes(slabs[0], data, "the allocator's buffer")

        got = await connector.get_into(key, lambda n: None)
        assert_same_bytes(got, data, "get_into when the allocator has no room")

    async def test_concurrent_writers_never_mix(self, connector: Connector, prefix: str) -> None:
        _need_data(connector.capabilities)
        _need_size(connector.capabilities, MiB)
        key = f"{prefix}contended"
        initial = make_bytes(MiB, seed=999)
        values = [make_bytes(MiB, seed=1000 + i) for i in range(8)]
        allowed = {digest(v) for v in values}
        await connector.put(key, initial)
        done = asyncio.Event()
        seen: list[str] = []

        async def read_until_done() -> None:
            while not done.is_set():
                got = await connector.get(key)
                assert got is not None, "a reader saw a miss while the key was always present"
                seen.append(digest(got))
                await asyncio.sleep(0)  # let writers run even if get never suspends

        async def write(value: bytes) -> None:
            await asyncio.sleep(0)
            await connector.put(key, value)

        readers = [asyncio.create_task(read_until_done()) for _ in range(4)]
        try:
            await asyncio.gather(*(write(v) for v in values))
        finally:
            done.set()
            await asyncio.gather(*readers)
        assert seen, "the readers never ran"
        torn = [d for d in seen if d not in allowed | {digest(initial)}]
        assert not torn, f"{len(torn)} of {len(seen)} reads returned a mix of values"
        final = await connector.get(key)
        assert final is not None
        assert digest(final) in allowed

    # -- listing --------------------------------------------------------------------------

    async def test_list_by_prefix(self, connector: Connector, prefix: str) -> None:
        caps = connector.capabilities
        if not caps.list:
            with pytest.raises(Unsupported):
                await listed(connector, prefix)
            return
        _need_data(caps)
        sizes = {"dir/a": 3, "dir/b": 0, "dirx": 1, "other": 4 * KiB}
        for name, size in sizes.items():
            await connector.put(prefix + name, make_bytes(size))
        assert await listed(connector, prefix + "dir/") == {
            prefix + "dir/a": 3,
            prefix + "dir/b": 0,
        }
        assert set(await listed(connector, prefix + "dir")) == {
            prefix + "dir/a",
            prefix + "dir/b",
            prefix + "dirx",
        }
        assert await listed(connector, prefix) == {prefix + k: n for k, n in sizes.items()}
        assert await listed(connector, prefix + "nothing-here") == {}
        await connector.delete(prefix + "dir/a")
        assert await listed(connector, prefix + "dir/") == {prefix + "dir/b": 0}

    # -- persistence ----------------------------------------------------------------------

    async def test_new_instance_sees_objects_after_close(
        self, connector_factory: ConnectorFactory, prefix: str
    ) -> None:
        first = await connector_factory()
        try:
            caps = first.capabilities
            if not caps.persistent:
                pytest.skip("the connector is not persistent")
            objects = {
                f"{prefix}p/{i}": make_bytes(size, seed=i) for i, size in enumerate((0, 1, MiB))
            }
            for key, data in objects.items():
                await first.put(key, data)
            await first.delete(f"{prefix}p/0")
        finally:
            await first.close()
        second = await connector_factory()
        try:
            assert await second.get(f"{prefix}p/0") is None
            for key in list(objects)[1:]:
                assert_same_bytes(await second.get(key), objects[key], f"{key!r} after reopen")
                assert await second.exists(key)
            if caps.list:
                assert await listed(second, f"{prefix}p/") == {
                    k: len(v) for k, v in list(objects.items())[1:]
                }
        finally:
            await second.close()

    # -- through a Store: frames, tensors and corruption on this backend -----------------

    @staticmethod
    async def _store_on(connector_factory: ConnectorFactory) -> tuple[Store, Connector]:
        """A Store whose only tier is a new connector (no memory tier: gets read the backend).

        The store closes the connector; one that stores nothing is closed here and skipped.
        """
        conn = await connector_factory()
        if not conn.capabilities.stores_data:
            await conn.close()
            pytest.skip("the connector does not store data (stores_data=False)")
        cfg = {"tiers": [{"url": f"{conn.scheme}://", "timeout": 30.0}], "staging": 64 * MiB}
        return Store(cfg, connectors={0: conn}), conn

    @pytest.mark.parametrize("dtype", STORE_DTYPES)
    async def test_store_round_trips_tensors(
        self, connector_factory: ConnectorFactory, prefix: str, dtype: str
    ) -> None:
        torch = pytest.importorskip("torch")
        store, _ = await self._store_on(connector_factory)
        src = torch.arange(2 * 3 * 40 * 64, dtype=torch.float32).reshape(2, 3, 40, 64) / 7
        src = src.to(getattr(torch, dtype))
        async with store:
            await store.put(f"{prefix}t", src, fmt=1)
            await store.flush()
            got = await store.get(f"{prefix}t")
        assert isinstance(got, torch.Tensor)
        assert got.dtype == src.dtype
        assert got.shape == src.shape
        assert torch.equal(got.view(torch.uint8), src.view(torch.uint8))

    async def test_store_round_trips_every_kind(
        self, connector_factory: ConnectorFactory, prefix: str
    ) -> None:
        store, _ = await self._store_on(connector_factory)
        objs: list[object] = [
            b"",
            make_bytes(4096),
            bytearray(make_bytes(100, 1)),
            memoryview(make_bytes(10, 2)),
            np.arange(60, dtype=np.float16).reshape(3, 4, 5),
        ]
        async with store:
            for i, obj in enumerate(objs):
                await store.put(f"{prefix}{i}", obj)
            await store.flush()
            for i, obj in enumerate(objs):
                got = await store.get(f"{prefix}{i}")
                assert type(got) is type(obj)
                if isinstance(obj, np.ndarray):
                    assert isinstance(got, np.ndarray)
                    np.testing.assert_array_equal(got, obj)
                else:
                    assert_same_bytes(got, obj)  # type: ignore[arg-type]

    async def test_store_serves_values_swapped_between_keys_as_misses(
        self, connector_factory: ConnectorFactory, prefix: str
    ) -> None:
        """A value moved to another key in the backend is that key's miss, never its object.

        The bytes are intact (their checksums pass): only the frame's binding to the key it was
        written under tells them apart. Put back under their own keys, they are served again.
        """
        store, conn = await self._store_on(connector_factory)
        a, b = f"{prefix}swap-a", f"{prefix}swap-b"
        value_a, value_b = make_bytes(48 * 1024, 11), make_bytes(48 * 1024, 12)
        async with store:
            await store.put(a, value_a)
            await store.put(b, value_b)
            await store.flush()
            blob_a = bytes(memoryview(await conn.get(a) or b"").cast("B"))
            blob_b = bytes(memoryview(await conn.get(b) or b"").cast("B"))
            assert blob_a, "the store wrote nothing"
            assert blob_b, "the store wrote nothing"
            await conn.put(a, blob_b)
            await conn.put(b, blob_a)
            assert await store.get(a) is None
            assert await store.get(b) is None
            stats = next(iter(store.stats().values()))
            assert stats.corrupt == 2
            await conn.put(a, blob_a)  # each value under its own key again: served
            await conn.put(b, blob_b)
            for key, value in ((a, value_a), (b, value_b)):
                got = await store.get(key)
                assert isinstance(got, bytes), f"{key}, moved back: {type(got).__name__}"
                assert_same_bytes(got, value, f"{key}, moved back")

    async def test_store_serves_corrupted_bytes_as_a_counted_miss(
        self, connector_factory: ConnectorFactory, prefix: str
    ) -> None:
        """Garbage written straight into the backend under a valid key is detected."""
        store, conn = await self._store_on(connector_factory)
        key = f"{prefix}victim"
        async with store:
            await store.put(key, make_bytes(64 * 1024, 3))
            await store.flush()
            blob = bytearray(memoryview(await conn.get(key) or b"").cast("B"))
            assert blob, "the store wrote nothing"
            blob[len(blob) // 2] ^= 0x5A  # one flipped byte in the payload
            await conn.put(key, bytes(blob))
            assert await store.get(key) is None
            stats = next(iter(store.stats().values()))
            assert stats.corrupt == 1
            await conn.put(key, b"not a frame at all")
            assert await store.get(key) is None
            assert stats.corrupt == 2
            await store.put(key, b"fresh")  # the key is usable again
            await store.flush()
            assert await store.get(key) == b"fresh"

    async def test_store_leaves_an_object_over_its_read_limit_in_place(
        self, connector_factory: ConnectorFactory, prefix: str
    ) -> None:
        """A store whose ``max_object_size`` is below a stored object's size reads it as a miss
        and leaves it for a store that takes it (perhaps the one that wrote it): a smaller
        limit on one reader must never delete another's data. One connector serves the three
        stores, so a backend that keeps objects per instance (in-process ones) is tested too.
        The object is larger than the small store's ``frame_limit`` (the read limit connectors
        see), so both the connector's size check and the frame's are exercised."""
        size = 3 * MiB
        key = f"{prefix}big"
        value = make_bytes(size, 21)
        conn = await connector_factory()
        try:
            caps = conn.capabilities
            if not caps.stores_data:
                pytest.skip("the connector does not store data (stores_data=False)")
            if caps.max_object_size is not None and caps.max_object_size < size + MiB:
                pytest.skip("the connector cannot hold the object and its frame")
            shared = _KeptOpen(conn)

            def store(max_object_size: int = 64 * MiB) -> Store:
                tier = {"url": f"{conn.scheme}://", "timeout": 30.0}
                cfg = {"tiers": [tier], "staging": 64 * MiB, "max_object_size": max_object_size}
                return Store(cfg, connectors={0: shared})

            async with store() as writer:
                await writer.put(key, value)
                await writer.flush()
            async with store(MiB) as small:
                assert await small.get(key) is None
            async with store() as again:
                got = await again.get(key)
                assert isinstance(got, bytes), "a reader with a lower limit removed the object"
                assert_same_bytes(got, value)
                await again.delete(key)
        finally:
            await conn.close()


class _KeptOpen(Layer):
    """A connector that stays open when a store closes it (the test closes it at the end)."""

    async def close(self) -> None:
        return None
