"""memcached:// behaviour beyond the conformance suite, on real memcached 1.6 servers.

aiomcache (a separate client) is the independent observer of what is on the server: which
part keys exist, how many items there are.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable

import aiomcache
import pytest
from servers.memcached import MemcachedServer

from connectors.memcached import MemcachedConnector
from connectors.memcached.config import ITEM_OVERHEAD, MiB, exptime
from connectors.memcached.connector import ObjectParts, split_value, value_head
from gateway.errors import (
    CapacityError,
    ConfigError,
    CorruptObject,
    GatewayError,
    Timeout,
    Unavailable,
)
from gateway.parts import Manifest, StripedObjects, parse_head
from gateway.store import Store
from gateway.testing import ODD_KEYS, assert_same_bytes, make_bytes

# Transports differ between asyncio's loop and uvloop (what `kvgate serve` runs on).
pytestmark = pytest.mark.both_loops

KiB = 1 << 10
_MEMCACHED_KEY = re.compile(rb"[\x21-\x7e]{1,250}")

StartServer = Callable[..., MemcachedServer]


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


@pytest.fixture
async def conn(memcached_server: str) -> AsyncIterator[MemcachedConnector]:
    c = MemcachedConnector.from_url(
        memcached_server,
        item_limit="64MiB",
        part_size="1MiB",
        inline_max="1MiB",
        namespace=f"t{uuid.uuid4().hex}:",
    )
    try:
        yield c
    finally:
        await c.close()


@pytest.fixture
async def observer(memcached_server: str) -> AsyncIterator[aiomcache.Client]:
    client = aiomcache.Client("127.0.0.1", _port(memcached_server))
    try:
        yield client
    finally:
        await client.close()


async def part_keys(conn: MemcachedConnector, key: str) -> list[bytes]:
    """The memcached keys of the parts ``key``'s stored object names ([] if inline)."""
    found = await conn.client.get(conn.main_key(key))
    assert found is not None, f"{key!r} is not stored"
    manifest = parse_head(split_value(found[0])[1])
    if manifest is None:
        return []
    backend = ObjectParts(conn.client, b"")
    naming = StripedObjects(backend, parts_prefix=conn.parts_prefix, part_size=1, inline_max=0)
    return naming.part_keys(manifest)


async def present(client: aiomcache.Client, keys: list[bytes]) -> list[bool]:
    return [await client.get(k) is not None for k in keys]


async def meta(port: int, command: bytes) -> bytes:
    """One meta command's reply line, on a connection of its own (aiomcache has no meta)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(command + b"\r\n")
        return (await reader.readline()).rstrip()
    finally:
        writer.close()
        await writer.wait_closed()


# -- URL, options and keys ----------------------------------------------------------------


def test_url_forms() -> None:
    assert str(MemcachedConnector.from_url("memcached://").address) == "memcached://127.0.0.1:11211"
    c = MemcachedConnector.from_url("memcached://[::1]:1234")
    assert (c.address.host, c.address.port) == ("::1", 1234)
    assert repr(c) == "MemcachedConnector(memcached://[::1]:1234)"
    with pytest.raises(ConfigError, match="no authentication") as err:
        MemcachedConnector.from_url("memcached://user:hunter2@host:1")
    assert "hunter2" not in str(err.value)
    for bad in (
        "memcached://h:1/db",
        "memcached://h:1?timeout=3",
        "redis://h:1",
        "memcached://h:x",
    ):
        with pytest.raises(ConfigError):
            MemcachedConnector.from_url(bad)


def test_options_are_checked() -> None:
    url = "memcached://h"
    with pytest.raises(ConfigError, match="part_size"):
        MemcachedConnector.from_url(url, part_size="1MiB")  # default item_limit is 1 MiB
    with pytest.raises(ConfigError, match="namespace"):
        MemcachedConnector.from_url(url, namespace="has space")
    with pytest.raises(ConfigError, match="capacity"):
        MemcachedConnector.from_url(url, capacity=1 << 30)  # memcached manages its memory
    with pytest.raises(ConfigError, match="timeout"):
        MemcachedConnector.from_url(url, timeout=0)


def test_defaults_follow_the_item_limit() -> None:
    c = MemcachedConnector.from_url("memcached://h")
    assert c.options.item_limit == MiB
    assert c.part_size == c.inline_max == MiB - ITEM_OVERHEAD
    assert c.capabilities.max_object_size is None
    assert not c.capabilities.list
    big = MemcachedConnector.from_url("memcached://h", item_limit="64MiB")
    assert big.part_size == MiB
    assert big.inline_max == 4 * MiB
    unsplit = MemcachedConnector.from_url("memcached://h", split=False)
    assert unsplit.capabilities.max_object_size == MiB - 4 * KiB
    capped = MemcachedConnector.from_url("memcached://h", split=False, max_object_size=1000)
    assert capped.capabilities.max_object_size == 1000


def test_exptime_follows_memcacheds_rule() -> None:
    assert exptime(None) == 0  # never expires
    assert exptime(0.2) == 1  # whole seconds, never 0 (which would mean "never")
    assert exptime(30 * 86400) == 30 * 86400  # up to 30 days: relative
    now = 1_700_000_000.0
    assert exptime(31 * 86400, now=now) == int(now) + 31 * 86400  # beyond: absolute


def test_every_key_maps_to_a_safe_distinct_memcached_key() -> None:
    c = MemcachedConnector.from_url("memcached://h", namespace="x" * 160)
    keys = [*ODD_KEYS, "", "\udc80 lone surrogate", "k" * 100_000]
    mapped = {c.main_key(k) for k in keys}
    assert len(mapped) == len(keys)
    for main in mapped:
        assert _MEMCACHED_KEY.fullmatch(main), main
    backend = ObjectParts(c.client, b"")
    naming = StripedObjects(backend, parts_prefix=c.parts_prefix, part_size=1, inline_max=0)
    part = naming.part_keys(Manifest(b"\xff" * 16, 1, 1, 1))[0]
    # A 1 TiB object of the smallest parts (4 KiB) has part numbers of 9 digits.
    assert _MEMCACHED_KEY.fullmatch(part[:-1] + b"9" * 9)


# -- objects and their parts on the server ------------------------------------------------


async def test_overwrite_and_delete_remove_superseded_parts(
    conn: MemcachedConnector, observer: aiomcache.Client
) -> None:
    key = "overwritten"
    first, second = make_bytes(5 * MiB, 1), make_bytes(3 * MiB + 5, 2)
    await conn.put(key, first)
    first_parts = await part_keys(conn, key)
    assert len(first_parts) == 5
    assert all(await present(observer, first_parts))
    await conn.put(key, second)
    second_parts = await part_keys(conn, key)
    assert len(second_parts) == 4
    assert all(await present(observer, second_parts))
    assert not any(await present(observer, first_parts))
    assert_same_bytes(await conn.get(key), second)
    await conn.put(key, b"small now")  # inline: the parts of the manifest it replaced go
    assert not any(await present(observer, second_parts))
    await conn.put(key, second)
    third_parts = await part_keys(conn, key)
    large_inline = make_bytes(MiB, 3)  # inline, and too large to be fetched by a swap
    await conn.put(key, large_inline)
    assert not any(await present(observer, third_parts))
    assert_same_bytes(await conn.get(key), large_inline)
    await conn.put(key, second)  # a manifest over a large inline object
    assert_same_bytes(await conn.get(key), second)
    last_parts = await part_keys(conn, key)
    assert await conn.delete(key)
    assert not any(await present(observer, last_parts))
    assert await observer.get(conn.main_key(key)) is None


async def test_parts_are_durable_after_the_commit(
    conn: MemcachedConnector, memcached_server: str
) -> None:
    """Parts are written with a pending expiry; the commit makes them never expire."""
    await conn.put("durable", make_bytes(2 * MiB))
    for part in await part_keys(conn, "durable"):
        assert await meta(_port(memcached_server), b"mg " + part + b" t") == b"HD t-1"


async def test_concurrent_overwrites_leave_only_the_winners_parts(
    memcached_factory: StartServer,
) -> None:
    """Writers race on one key; each superseded manifest's parts are deleted (once)."""
    server = memcached_factory(memory_mb=256)
    c = MemcachedConnector.from_url(
        server.url, item_limit="64MiB", part_size="256KiB", inline_max="256KiB"
    )
    observer = aiomcache.Client("127.0.0.1", server.port)
    try:
        for round_ in range(3):
            # Manifests of 5 parts, large inline objects (not fetched by a swap), small ones.
            sizes = [MiB + 1, 200 * KiB, MiB + 2, 100, 200 * KiB + 1, MiB + 3, 10, MiB + 4]
            values = [make_bytes(n, seed=10 * round_ + i) for i, n in enumerate(sizes)]
            await c.put("k", make_bytes(3 * MiB, seed=99))
            await asyncio.gather(*(c.put("k", v) for v in values))
            final = await c.get("k")
            assert final is not None
            assert bytes(final) in values
            parts = -(-len(final) // (256 * KiB)) if len(final) > 256 * KiB else 0
            stats = await observer.stats()
            # The main key and the winner's parts: every superseded part was deleted.
            assert int(stats[b"curr_items"] or 0) == 1 + parts
    finally:
        await observer.close()
        await c.close()


async def test_a_missing_or_altered_part_is_a_miss(
    conn: MemcachedConnector, observer: aiomcache.Client
) -> None:
    for i, damage in enumerate(("deleted", "shortened")):
        key = f"damaged-{damage}"
        await conn.put(key, make_bytes(4 * MiB, seed=i))
        victim = (await part_keys(conn, key))[2]
        if damage == "deleted":  # as memcached's eviction would
            assert await observer.delete(victim)
        else:
            await observer.set(victim, b"not the part it was")
        assert await conn.get(key) is None
        assert await conn.get_into(key, lambda n: memoryview(bytearray(n))) is None
        assert await conn.exists(key)  # exists reads the main key only (documented)
        await conn.put(key, b"usable again")
        assert await conn.get(key) == b"usable again"


async def test_another_keys_value_under_the_hash_is_a_miss(conn: MemcachedConnector) -> None:
    """A hash collision, simulated: the main key holds the object of another key."""
    main = conn.main_key("mine")
    other = [memoryview(value_head(b"theirs")), memoryview(b"\x00their object")]
    assert await conn.client.store(b"set", main, other, 0)
    assert await conn.get("mine") is None
    assert await conn.get_into("mine", lambda n: memoryview(bytearray(n))) is None
    assert await conn.delete("mine") is False  # not ours to delete
    assert await conn.client.get(main) is not None
    await conn.put("mine", b"my object")
    assert await conn.get("mine") == b"my object"


async def test_a_foreign_value_is_corrupt_and_deletable(
    conn: MemcachedConnector, observer: aiomcache.Client
) -> None:
    await observer.set(conn.main_key("foreign"), b"written by something else")
    with pytest.raises(CorruptObject):
        await conn.get("foreign")
    assert await conn.delete("foreign") is True
    assert await conn.get("foreign") is None


async def test_server_side_ttl(memcached_server: str) -> None:
    ns = f"ttl{uuid.uuid4().hex}:"
    # memcached's clock ticks in whole seconds, so a 1 s TTL can lapse at once; 4 s leaves a
    # loaded machine time to read the object back before it goes.
    ttl = 4
    short = MemcachedConnector.from_url(
        memcached_server, item_limit="64MiB", inline_max="1MiB", ttl=ttl, namespace=ns
    )
    forty_days = MemcachedConnector.from_url(
        memcached_server, item_limit="64MiB", ttl=40 * 86400, namespace=ns
    )
    try:
        # 40 days is sent as an absolute time; sent as seconds it would mean 1970: gone.
        await forty_days.put("kept-small", b"stays")
        await forty_days.put("kept-large", make_bytes(3 * MiB, 5))
        await short.put("small", b"expires")
        assert await short.get("small") == b"expires"
        await short.put("large", make_bytes(3 * MiB))
        large_parts = await part_keys(short, "large")
        await asyncio.sleep(ttl + 1.5)
        assert await short.get("small") is None
        assert await short.get("large") is None
        # Parts outlive their object by the engine's pending margin (an hour), never less.
        for part in large_parts:
            reply = await meta(_port(memcached_server), b"mg " + part + b" t")
            assert reply.startswith(b"HD t"), reply
            assert 3590 < int(reply[4:]) <= 3601, reply
        assert await forty_days.get("kept-small") == b"stays"
        assert_same_bytes(await forty_days.get("kept-large"), make_bytes(3 * MiB, 5))
    finally:
        await short.close()
        await forty_days.close()


# -- item limits --------------------------------------------------------------------------


async def test_default_item_limit_server_with_default_options(
    memcached_factory: StartServer,
) -> None:
    """Against memcached's own default -I (1 MiB), the defaults' sizes fit a real server."""
    server = memcached_factory(memory_mb=128, item_limit="")
    c = MemcachedConnector.from_url(server.url)
    try:
        long_key = "k" * 3000
        for key, size in [
            ("parts", 8 * MiB + 3),
            ("inline at the limit", c.inline_max),
            (long_key, c.inline_max),  # the head leaves less room: stored as a part instead
            ("x" * 250, c.part_size + 1),
        ]:
            data = make_bytes(size, seed=size)
            await c.put(key, data)
            assert_same_bytes(await c.get(key), data, f"{size} bytes under {key[:20]!r}")
    finally:
        await c.close()


async def test_split_false_refuses_what_one_item_cannot_hold(
    memcached_factory: StartServer,
) -> None:
    server = memcached_factory(memory_mb=64, item_limit="")
    c = MemcachedConnector.from_url(server.url, split=False)
    try:
        limit = c.capabilities.max_object_size
        assert limit == MiB - 4 * KiB
        with pytest.raises(CapacityError, match="split=false"):
            await c.put("two-mib", make_bytes(2 * MiB))
        assert await c.get("two-mib") is None
        data = make_bytes(limit)  # the declared limit holds for keys up to ~3 KiB
        for key in ("short", "k" * 3000):
            await c.put(key, data)
            assert_same_bytes(await c.get(key), data)
    finally:
        await c.close()


async def test_item_limit_above_the_servers_is_a_capacity_error(
    memcached_factory: StartServer,
) -> None:
    """A connector told -I 64m against a server at -I 1m: the server's refusal maps cleanly."""
    server = memcached_factory(memory_mb=64, item_limit="")
    for options in ({"split": False}, {"part_size": "4MiB"}):
        c = MemcachedConnector.from_url(server.url, item_limit="64MiB", **options)
        try:
            with pytest.raises(CapacityError, match=r"too large.*item_limit"):
                await c.put("big", make_bytes(4 * MiB + 1))
            assert await c.get("big") is None
            await c.put("small", b"still fine")  # the connection is in step
            assert await c.get("small") == b"still fine"
        finally:
            await c.close()


async def test_too_little_server_memory_misses_or_fails_never_lies(
    memcached_factory: StartServer,
) -> None:
    for extra in ((), ("-M",)):  # evicting, then refusing (-M: no eviction)
        server = memcached_factory(memory_mb=8, item_limit="", extra=extra)
        c = MemcachedConnector.from_url(server.url)
        stored: dict[str, bytes] = {}
        failures = 0
        try:
            for i in range(10):
                data = make_bytes(3 * MiB, seed=i)
                try:
                    await c.put(f"o{i}", data)
                    stored[f"o{i}"] = data
                except CapacityError:
                    failures += 1
            hits = 0
            for key, data in stored.items():
                got = await c.get(key)
                if got is not None:
                    assert_same_bytes(got, data, key)
                    hits += 1
            assert hits >= 1  # the server holds something ...
            assert hits < 10  # ... but not 30 MiB in 8 MiB
            assert failures > 0 if extra else failures == 0
        finally:
            await c.close()


# -- faults: timeouts, a vanishing server, bad replies ------------------------------------


async def test_cancelled_calls_never_leave_replies_for_later_ones(
    conn: MemcachedConnector,
) -> None:
    """The aiomcache#489 failure: a timed-out call's reply read by the next command."""
    big = make_bytes(40 * MiB)
    await conn.put("big", big)
    for i in range(5):
        await conn.put(f"ok{i}", f"value {i}".encode())
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.002):
                await conn.put(f"big{i}", big)  # cancelled mid-write or before its reply
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.002):
                await conn.get("big")  # cancelled mid-value
        assert await conn.get(f"ok{i}") == f"value {i}".encode()
        assert await conn.delete(f"ok{i}") is True
        assert await conn.delete(f"ok{i}") is False


async def test_stopped_server_times_out_then_recovers(memcached_factory: StartServer) -> None:
    server = memcached_factory(memory_mb=256)
    c = MemcachedConnector.from_url(server.url, item_limit="64MiB", timeout=0.5)
    assert server.process.proc is not None
    pid = server.process.proc.pid
    data = make_bytes(8 * MiB)
    try:
        await c.put("before", data)
        os.kill(pid, signal.SIGSTOP)
        try:
            for call in (c.get("before"), c.put("during", data), c.exists("before")):
                started = time.monotonic()
                with pytest.raises(Timeout):
                    await call
                # A failed put also tries to remove its parts: a second timeout at most.
                assert time.monotonic() - started < 2 * 0.5 + 4.0  # the server never answers
        finally:
            os.kill(pid, signal.SIGCONT)
        assert_same_bytes(await c.get("before"), data)
        await c.put("after", b"fine")
        assert await c.get("after") == b"fine"
    finally:
        await c.close()


async def test_killed_server_is_unavailable_then_back(memcached_factory: StartServer) -> None:
    server = memcached_factory(memory_mb=256)
    c = MemcachedConnector.from_url(server.url, item_limit="64MiB", timeout=30)
    data = make_bytes(64 * MiB)
    try:
        await c.put("big", data)
        reading = asyncio.create_task(c.get("big"))
        await asyncio.sleep(0.01)
        started = time.monotonic()
        server.process.kill()  # mid-reply, unless the get was already done
        try:
            got = await reading
            assert_same_bytes(got, data)
        except Unavailable:
            pass
        assert time.monotonic() - started < 10.0  # the kill is noticed, not the 30 s timeout
        with pytest.raises(Unavailable):
            await c.get("big")
        server.process.start()
        assert await c.get("big") is None  # a fresh, empty server on the same port
        await c.put("again", b"back")
        assert await c.get("again") == b"back"
    finally:
        await c.close()


@contextlib.asynccontextmanager
async def fake_server(reply: bytes | None) -> AsyncIterator[int]:
    """A TCP server (its port) that answers a request with ``reply`` and hangs up, or with
    None never answers. Every connection it accepted is closed on exit."""
    writers: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        await reader.readline()
        if reply is not None:
            writer.write(reply)
            await writer.drain()
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for writer in writers:
            writer.close()
        await server.wait_closed()
        for writer in writers:
            with contextlib.suppress(OSError):
                await writer.wait_closed()


@pytest.mark.parametrize(
    ("reply", "error"),
    [
        (b"VALUE %s 0 100\r\n" + b"x" * 10, Unavailable),  # truncated mid-value
        (b"VALUE %s 0 4\r\nabcd", Unavailable),  # no CRLF, no END
        (b"VALUE %s 0 4\r\nabcdXYEND\r\n", GatewayError),  # a value not ended by CRLF
        (b"VALUE someone-else 0 4\r\nabcd\r\nEND\r\n", GatewayError),
        (b"", Unavailable),  # hung up without a word
    ],
    ids=["truncated-value", "no-end", "bad-trailer", "other-key", "silent-close"],
)
async def test_bad_replies_are_errors_never_values(reply: bytes, error: type[Exception]) -> None:
    main = MemcachedConnector.from_url("memcached://").main_key("k")
    async with fake_server(reply.replace(b"%s", main)) as port:
        c = MemcachedConnector.from_url(f"memcached://127.0.0.1:{port}", timeout=2)
        try:
            with pytest.raises(error):
                await c.get("k")
        finally:
            await c.close()


async def test_silent_server_times_out() -> None:
    async with fake_server(None) as port:
        c = MemcachedConnector.from_url(f"memcached://127.0.0.1:{port}", timeout=0.3)
        try:
            started = time.monotonic()
            with pytest.raises(Timeout):
                await c.get("k")
            assert time.monotonic() - started < 5.0  # 0.3 s, against a silence with no end
        finally:
            await c.close()


async def test_refused_connection_is_unavailable() -> None:
    c = MemcachedConnector.from_url("memcached://127.0.0.1:1")
    try:
        with pytest.raises(Unavailable):
            await c.ping()
    finally:
        await c.close()


async def test_store_survives_a_killed_server_and_uses_it_again(
    memcached_factory: StartServer,
) -> None:
    server = memcached_factory(memory_mb=256)
    cfg = {
        "tiers": [
            {
                "url": server.url,
                "timeout": 1.0,
                "options": {"item_limit": "64MiB", "timeout": 1.0},
                "breaker": {"failures": 3, "reset_after": 1.0},
                "retry": {"attempts": 1},
            }
        ],
        "staging": 64 * MiB,
    }
    async with Store(cfg) as store:
        data = make_bytes(2 * MiB)
        await store.put("a", data)
        await store.flush()
        server.process.kill()
        for i in range(8):
            started = time.monotonic()
            assert await store.get(f"missing-{i}") is None  # a failing tier is a miss
            await store.put(f"b{i}", data)
            await store.flush()
            assert time.monotonic() - started < 1.0 * 3 + 1.0
        tier = next(iter(store.stats().values()))
        assert tier.errors.get("unavailable", 0) > 0
        assert tier.errors.get("circuit_open", 0) > 0  # the breaker opened
        server.process.start()
        deadline = time.monotonic() + 10
        while True:
            await store.put("c", data)
            await store.flush()
            got = await store.get("c")
            if got is not None:
                assert_same_bytes(got, data)
                break
            assert time.monotonic() < deadline, "the tier was not used again"
            await asyncio.sleep(0.2)


# -- the benchmark hook -------------------------------------------------------------------


async def test_raw_client_baseline_measures_and_cleans_up(memcached_factory: StartServer) -> None:
    server = memcached_factory(memory_mb=256)
    put_gbps, get_gbps = await MemcachedConnector.raw_client_baseline(
        server.url,
        {},
        size=256 * KiB,
        count=8,
        concurrency=2,
        payloads=[bytes([i]) * 256 * KiB for i in range(3)],
    )
    assert put_gbps > 0
    assert get_gbps > 0
    observer = aiomcache.Client("127.0.0.1", server.port)
    try:
        assert (await observer.stats())[b"curr_items"] == b"0"
    finally:
        await observer.close()
