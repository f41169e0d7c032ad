"""Behaviour of the Redis connectors beyond the conformance suite, on real redis-server processes:
URL and option checks, credentials, how objects and their parts sit on the server (partial sets,
superseded parts, garbage, TTLs), listing with glob characters, a full server, a cluster's hash
tags, TLS trust, replica acknowledgements, and the fast path against a scripted peer.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from redis.exceptions import MovedError, ResponseError
from servers.proc import free_port
from servers.redis import PASSWORD, RedisClusterGroup, RedisNode
from servers.redis_script import Script, read_command
from servers.tls import make_certificates

from connectors.redis import RedisConnector
from connectors.redis.config import RedisOptions, resolve
from connectors.redis.resp import Incomplete, ProtocolError, parse_reply
from gateway.errors import (
    CapacityError,
    ConfigError,
    CorruptObject,
    GatewayError,
    Timeout,
    Unavailable,
)
from gateway.parts import MalformedValue
from gateway.store import Store
from gateway.testing import assert_same_bytes, listed, make_bytes

# Transports differ between asyncio's loop and uvloop (what `kvgate serve` runs on).
pytestmark = pytest.mark.both_loops

KiB, MiB = 1 << 10, 1 << 20
SMALL_PARTS = {"part_size": 64 * KiB, "inline_max": 4 * KiB}


def _namespace() -> str:
    return f"t-{uuid.uuid4().hex[:10]}:"


def _keys(node: RedisNode, pattern: str) -> list[bytes]:
    return sorted(node.client().scan_iter(match=pattern, count=1000))


# -- URLs and options -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "mode", "hosts", "db", "service", "user", "password"),
    [
        ("redis://h", "standalone", (("h", 6379),), 0, None, None, None),
        ("redis://:pw@h:7000/3", "standalone", (("h", 7000),), 3, None, None, "pw"),
        ("redis://u:p%40ss@h/1", "standalone", (("h", 6379),), 1, None, "u", "p@ss"),
        ("redis://tok@h", "standalone", (("h", 6379),), 0, None, None, "tok"),
        ("rediss://[::1]:7001", "standalone", (("::1", 7001),), 0, None, None, None),
        ("unix:///run/redis.sock", "standalone", (), 0, None, None, None),
        (
            "redis+sentinel://pw@s1,s2:5000/mymaster/2",
            "sentinel",
            (("s1", 26379), ("s2", 5000)),
            2,
            "mymaster",
            None,
            "pw",
        ),
        ("redis+cluster://a:1,b:2", "cluster", (("a", 1), ("b", 2)), 0, None, None, None),
    ],
)
def test_url_forms(
    url: str,
    mode: str,
    hosts: tuple[tuple[str, int], ...],
    db: int,
    service: str | None,
    user: str | None,
    password: str | None,
) -> None:
    target = resolve(url, RedisOptions())
    assert (target.mode, target.hosts, target.db, target.service) == (mode, hosts, db, service)
    assert (target.username, target.password) == (user, password)
    assert target.tls == url.startswith("rediss")
    if password:
        assert password not in repr(target)


@pytest.mark.parametrize(
    ("url", "options", "complaint"),
    [
        ("redis://h?db=1", {}, "keyword arguments"),
        ("redis://h", {"no_such_option": 1}, "no_such_option"),
        ("redis://h", {"capacity": 1 << 30}, "capacity"),
        ("redis://:secret-in-url@h", {"password": "secret-in-option"}, "give one"),
        ("redis://h/1", {"db": 2}, "give one"),
        ("redis://h", {"ssl_ca_certs": "/ca.pem"}, "rediss://"),
        ("redis://h", {"sentinel_password": "x"}, "redis+sentinel://"),
        ("redis+cluster://h/1", {}, "database 0"),
        ("redis+cluster://h", {"min_replicas_ack": 1}, "min_replicas_ack"),
        ("redis://h", {"min_replicas_ack": 1, "fast_path": False}, "needs fast_path"),
        ("redis+sentinel://h", {}, "service_name"),
        ("redis://a,b", {}, "one host"),
        ("unix://host/run/redis.sock", {}, "unix:///"),
        ("redis://h:99999", {}, "out of range"),
        ("redis://h/x", {}, "number"),
        ("memcached://h", {}, "is not one of"),
    ],
)
def test_bad_urls_and_options_are_config_errors(
    url: str, options: dict[str, Any], complaint: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(complaint)) as info:
        RedisConnector.from_url(url, **options)
    assert "secret-in" not in str(info.value)


def test_scheme_follows_the_url(make_conn: Callable[..., RedisConnector]) -> None:
    for url in (
        "redis://h",
        "rediss://h",
        "unix:///s",
        "redis+cluster://h",
        "redis+sentinel://h/m",
    ):
        assert make_conn(url).scheme == url.partition(":")[0]


# -- credentials ----------------------------------------------------------------------------


async def test_wrong_or_missing_password_is_a_config_error_without_the_secret(
    redis_auth_server: RedisNode, make_conn: Callable[..., RedisConnector]
) -> None:
    wrong = "wrong-Secret-4711"
    for conn in (
        make_conn(redis_auth_server.url, password=wrong),
        make_conn(redis_auth_server.url.replace("redis://", f"redis://:{wrong}@")),
        make_conn(redis_auth_server.url),  # no password: NOAUTH
    ):
        with pytest.raises(ConfigError, match="authentication") as info:
            await conn.get("k")
        assert wrong not in str(info.value)
        assert wrong not in repr(conn)
        with pytest.raises(ConfigError):
            await conn.put("k", make_bytes(9 * MiB))  # parts: the fast path's AUTH


async def test_right_password_from_url_or_option(
    redis_auth_server: RedisNode, make_conn: Callable[..., RedisConnector]
) -> None:
    data = make_bytes(9 * MiB, seed=4)
    url_with_password = redis_auth_server.url.replace("redis://", f"redis://:{PASSWORD}@")
    for conn in (
        make_conn(redis_auth_server.url, password=PASSWORD, namespace=_namespace()),
        make_conn(url_with_password, namespace=_namespace()),
    ):
        await conn.put("big", data)
        assert_same_bytes(await conn.get("big"), data)
        assert PASSWORD not in repr(conn)
        assert await conn.delete("big")


async def test_untrusted_tls_certificate_is_a_config_error(
    redis_tls_server: RedisNode, tmp_path: Path, make_conn: Callable[..., RedisConnector]
) -> None:
    other_ca = make_certificates(tmp_path / "other").ca
    conn = make_conn(redis_tls_server.url, ssl_ca_certs=str(other_ca))
    with pytest.raises(ConfigError, match="certificate"):
        await conn.get("k")


# -- objects on the server ------------------------------------------------------------------


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast-path", "redis-py"])
async def test_partial_or_resized_part_set_is_a_miss(
    redis_server: RedisNode, make_conn: Callable[..., RedisConnector], fast_path: bool
) -> None:
    ns = _namespace()
    conn = make_conn(redis_server.url, namespace=ns, fast_path=fast_path, **SMALL_PARTS)
    client = redis_server.client()
    data = make_bytes(MiB + 5, seed=1)
    await conn.put("victim", data)
    parts = _keys(redis_server, f"{ns}p:*")
    assert len(parts) == 17
    client.delete(parts[3])  # a part evicted or lost
    assert await conn.get("victim") is None
    assert await conn.get_into("victim", lambda n: memoryview(bytearray(n))) is None

    await conn.put("victim", data)
    parts = _keys(redis_server, f"{ns}p:*")
    client.set(parts[0], b"short", keepttl=True)  # a part of another length
    assert await conn.get("victim") is None
    await conn.put("victim", data)  # the fast path's connections are still good
    assert_same_bytes(await conn.get("victim"), data)


async def test_overwrite_and_delete_leave_no_parts_behind(
    redis_server: RedisNode, make_conn: Callable[..., RedisConnector]
) -> None:
    ns = _namespace()
    conn = make_conn(redis_server.url, namespace=ns, **SMALL_PARTS)
    await conn.put("k", make_bytes(MiB, seed=1))
    first = _keys(redis_server, f"{ns}p:*")
    assert len(first) == 16
    second_data = make_bytes(200 * KiB, seed=2)
    await conn.put("k", second_data)
    second = _keys(redis_server, f"{ns}p:*")
    assert len(second) == 4
    assert not set(first) & set(second), "the superseded parts are still there"
    assert_same_bytes(await conn.get("k"), second_data)
    await conn.put("k", b"inline now")
    assert _keys(redis_server, f"{ns}p:*") == []
    await conn.put("k", make_bytes(MiB, seed=3))
    assert await conn.delete("k")
    assert _keys(redis_server, f"{ns}*") == []
    # Parts of a committed object never expire; an expiring object's parts do.
    await conn.put("durable", make_bytes(100 * KiB))
    client = redis_server.client()
    assert {client.pttl(k) for k in _keys(redis_server, f"{ns}p:*")} == {-1}


async def test_concurrent_parted_writers_of_one_key_all_succeed_and_leave_one_object(
    redis_server: RedisNode, make_conn: Callable[..., RedisConnector]
) -> None:
    """A put superseded while it commits (its parts removed by the next put) still succeeds,
    and only the winner's parts stay."""
    ns = _namespace()
    conns = [make_conn(redis_server.url, namespace=ns, **SMALL_PARTS) for _ in range(4)]
    values = [make_bytes(300 * KiB, seed=i) for i in range(8)]
    for _ in range(10):
        await asyncio.gather(*(conns[i % 4].put("k", v) for i, v in enumerate(values)))
        got = await conns[0].get("k")
        assert got is not None
        assert bytes(got) in values
        assert len(_keys(redis_server, f"{ns}p:*")) == 5  # 300 KiB in 64 KiB parts


@pytest.mark.parametrize(
    "garbage",
    [
        b"",
        b"\x07not ours",
        b"\x01too short for a manifest",
        b"\x01" + b"\x00" * 41,
        b"\x01" + b"long" * 100,
        b"\x07" * 5000,
    ],
    ids=["empty", "unknown-tag", "short-manifest", "bad-magic", "long-manifest", "long"],
)
async def test_garbage_under_a_main_key_is_corrupt(
    redis_server: RedisNode, make_conn: Callable[..., RedisConnector], garbage: bytes
) -> None:
    ns = _namespace()
    conn = make_conn(redis_server.url, namespace=ns)
    redis_server.client().set(f"{ns}o:junk".encode(), garbage)
    with pytest.raises(CorruptObject) as info:
        await conn.get("junk")
    assert isinstance(info.value, MalformedValue)
    with pytest.raises(CorruptObject):
        await conn.get_into("junk", lambda n: memoryview(bytearray(n)))
    assert await listed(conn, "") == {}  # not an object of ours: not listed
    assert await conn.delete("junk")  # but it can be deleted
    redis_server.client().rpush(f"{ns}o:list", b"x")  # a key of another type
    with pytest.raises(CorruptObject, match="WRONGTYPE"):
        await conn.get("list")
    await conn.put("list", b"ours now")  # a put replaces it
    assert await conn.get("list") == b"ours now"
    redis_server.client().rpush(f"{ns}o:list2", b"x")
    assert await conn.delete("list2")


async def test_store_counts_garbage_as_a_corrupt_miss(
    redis_server: RedisNode, make_conn: Callable[..., RedisConnector]
) -> None:
    ns = _namespace()
    conn = make_conn(redis_server.url, namespace=ns)
    cfg = {"tiers": [{"url": "redis://", "timeout": 10.0}], "staging": 64 * MiB}
    store = Store(cfg, connectors={0: conn})
    async with store:
        await store.put("k", make_bytes(10 * KiB))
        await store.flush()
        redis_server.client().set(f"{ns}o:k".encode(), b"\x05garbage")
        assert await store.get("k") is None
        stats = next(iter(store.stats().values()))
        assert stats.corrupt == 1


async def test_list_matches_glob_characters_literally(
    redis_server: RedisNode, make_conn: Callable[..., RedisConnector]
) -> None:
    conn = make_conn(redis_server.url, namespace=_namespace() + "[*]?\\", **SMALL_PARTS)
    sizes = {"a*b": 1, "a?c": 2, "a[x]": 3, "a\\d": 4, "ab": 5, "a]": 6, "big": 300 * KiB}
    for key, size in sizes.items():
        await conn.put(key, make_bytes(size))
    assert await listed(conn, "") == sizes
    assert await listed(conn, "a*") == {"a*b": 1}
    assert await listed(conn, "a?") == {"a?c": 2}
    assert await listed(conn, "a[") == {"a[x]": 3}
    assert await listed(conn, "a\\") == {"a\\d": 4}
    assert await listed(conn, "a]") == {"a]": 6}
    assert await listed(conn, "b") == {"big": 300 * KiB}


async def test_namespaces_do_not_see_each_other(
    redis_server: RedisNode, make_conn: Callable[..., RedisConnector]
) -> None:
    one = make_conn(redis_server.url, namespace=_namespace())
    two = make_conn(redis_server.url, namespace=_namespace())
    await one.put("k", b"one")
    assert await two.get("k") is None
    assert await listed(two, "") == {}
    await two.put("k", b"two")
    assert await one.get("k") == b"one"


async def test_ttl_option_expires_objects_on_the_server(
    redis_server: RedisNode, make_conn: Callable[..., RedisConnector]
) -> None:
    ns = _namespace()
    # 3 s, not 1: a loaded machine can take a second between the put and the PTTL check.
    conn = make_conn(redis_server.url, namespace=ns, ttl=3.0, **SMALL_PARTS)
    await conn.put("inline", b"short-lived")
    await conn.put("parted", make_bytes(200 * KiB))
    client = redis_server.client()
    assert 0 < client.pttl(f"{ns}o:parted".encode()) <= 3000
    assert all(client.pttl(k) > 0 for k in _keys(redis_server, f"{ns}p:*"))  # they expire too
    await asyncio.sleep(3.2)
    assert await conn.get("inline") is None
    assert await conn.get("parted") is None
    assert not await conn.exists("parted")


async def test_full_server_is_a_capacity_error(
    redis_factory: Callable[..., RedisNode], make_conn: Callable[..., RedisConnector]
) -> None:
    node = redis_factory(extra=["--maxmemory", "8mb", "--maxmemory-policy", "noeviction"])
    conn = make_conn(node.url, part_size=MiB)

    async def fill() -> None:
        for i in range(20):
            await conn.put(f"fill/{i}", make_bytes(MiB - 100, seed=i))

    with pytest.raises(CapacityError, match="maxmemory"):
        await fill()
    with pytest.raises(CapacityError):
        await conn.put("big", make_bytes(16 * MiB))
    # The parts of the failed put were removed.
    assert len(node.client().keys("kvgate:p:*")) == 0


async def test_an_acl_refusal_is_a_config_error_that_names_the_acl(
    redis_factory: Callable[..., RedisNode], make_conn: Callable[..., RedisConnector]
) -> None:
    """Logged in, refused by the user's ACL: not "authentication failed: check username and
    password", which sent the user to the wrong problem."""
    node = redis_factory()
    node.cli("ACL", "SETUSER", "reader", "on", ">Pw-3", "~*", "+@read", "+@connection")
    conn = make_conn(f"redis://reader:Pw-3@127.0.0.1:{node.port}/0")
    for call in (lambda: conn.put("k", b"v"), lambda: conn.put("k", make_bytes(9 * MiB))):
        with pytest.raises(ConfigError, match="ACL refuses") as info:
            await call()
        assert "authentication failed" not in str(info.value)
        assert "Pw-3" not in str(info.value)


async def test_unreachable_servers_are_unavailable_quickly(
    make_conn: Callable[..., RedisConnector],
) -> None:
    port = free_port()
    urls = [
        f"redis://127.0.0.1:{port}",
        f"redis+sentinel://127.0.0.1:{port}/mymaster",
        f"redis+cluster://127.0.0.1:{port}",
        f"unix:///nonexistent-{port}/redis.sock",
    ]
    for url in urls:
        conn = make_conn(url, socket_connect_timeout=1.0)
        start = time.monotonic()
        with pytest.raises(Unavailable):
            await conn.put("k", make_bytes(5 * MiB))
        with pytest.raises(Unavailable):
            await conn.get("k")
        assert time.monotonic() - start < 6.0, url


async def test_replica_acknowledgement_is_required_when_asked(
    redis_server: RedisNode, make_conn: Callable[..., RedisConnector]
) -> None:
    conn = make_conn(
        redis_server.url,
        namespace=_namespace(),
        min_replicas_ack=1,
        replicas_ack_timeout=0.05,
        **SMALL_PARTS,
    )
    for data in (b"inline", make_bytes(300 * KiB)):
        with pytest.raises(Unavailable, match="only 0 of 1 replicas"):
            await conn.put("k", data)


async def test_cluster_spreads_parts_and_keeps_hash_tagged_keys_apart(
    redis_cluster: RedisClusterGroup, make_conn: Callable[..., RedisConnector]
) -> None:
    ns = _namespace()
    conn = make_conn(redis_cluster.url, namespace=ns, part_size=64 * KiB)
    data = make_bytes(2 * MiB, seed=9)
    await conn.put("{tag}a", data)
    holding = [n for n in redis_cluster.nodes if n.client().keys(f"{ns}p:*")]
    assert len(holding) == 3, "the parts of one object should spread over every node"
    values = {k: make_bytes(70 * KiB, seed=i) for i, k in enumerate(["{tag}b", "{}c", "{", "}{"])}
    for key, value in values.items():
        await conn.put(key, value)
    assert_same_bytes(await conn.get("{tag}a"), data)
    for key, value in values.items():
        assert_same_bytes(await conn.get(key), value, key)
    assert await listed(conn, "{") == {"{tag}a": len(data)} | {
        k: len(v) for k, v in values.items() if k.startswith("{")
    }
    for key in [*values, "{tag}a"]:
        assert await conn.delete(key)
    assert not any(n.client().keys(f"{ns}*") for n in redis_cluster.nodes)


# -- the fast path against a scripted peer ---------------------------------------------------


def test_small_replies_parse_whole_or_ask_for_more() -> None:
    stream = b"+OK\r\n*3\r\n$3\r\nabc\r\n:42\r\n$-1\r\n-WRONGTYPE no\r\n-MOVED 7 h:1\r\n"
    buf, pos, replies = bytearray(stream), 0, []
    while pos < len(buf):
        reply, pos = parse_reply(buf, pos)
        replies.append(reply)
    assert replies[:2] == [b"OK", [b"abc", 42, None]]
    assert isinstance(replies[2], ResponseError)
    assert "no" in str(replies[2])
    assert isinstance(replies[3], MovedError)
    array = b"*3\r\n$3\r\nabc\r\n:42\r\n$-1\r\n"
    assert parse_reply(bytearray(array), 0) == ([b"abc", 42, None], len(array))
    for cut in range(len(array)):  # every prefix of the array: wait for more
        with pytest.raises(Incomplete):
            parse_reply(bytearray(array[:cut]), 0)
    for bad in (b"?what\r\n", b"$3\r\nabcXY", b":x\r\n"):
        with pytest.raises(ProtocolError):
            parse_reply(bytearray(bad), 0)


async def _fast_get(conn: RedisConnector, key: bytes, dst: memoryview) -> bool | None:
    assert conn.fast is not None
    return await conn.fast.read_into(key, dst)


async def test_fast_path_parses_replies_split_anywhere(
    scripted: Callable[[Script], Awaitable[str]], make_conn: Callable[..., RedisConnector]
) -> None:
    payload = make_bytes(3000, seed=5)

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        replies = {
            b"hit": b"$%d\r\n%s\r\n" % (len(payload), payload),
            b"miss": b"$-1\r\n",
            b"err": b"-ERR something broke\r\n",
        }
        while True:
            _, key = await read_command(reader)
            for i in range(len(replies[key])):  # one byte at a time
                writer.write(replies[key][i : i + 1])
                await writer.drain()

    conn = make_conn(await scripted(script))
    dst = memoryview(bytearray(len(payload)))
    assert await _fast_get(conn, b"hit", dst) is True
    assert bytes(dst) == payload
    assert await _fast_get(conn, b"miss", dst) is False
    with pytest.raises(GatewayError, match="something broke"):
        await _fast_get(conn, b"err", dst)
    assert await _fast_get(conn, b"hit", dst) is True  # the same connection, still in step


async def test_fast_path_wrong_length_is_a_miss_and_drops_the_connection(
    scripted: Callable[[Script], Awaitable[str]], make_conn: Callable[..., RedisConnector]
) -> None:
    connections = 0

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while True:
            await read_command(reader)
            writer.write(b"$5\r\nabcde\r\n")

    conn = make_conn(await scripted(script))
    assert await _fast_get(conn, b"k", memoryview(bytearray(4))) is False
    assert await _fast_get(conn, b"k", memoryview(bytearray(5))) is True
    assert connections == 2


async def test_fast_path_failures_are_mapped_and_stop_writing_into_the_buffer(
    scripted: Callable[[Script], Awaitable[str]], make_conn: Callable[..., RedisConnector]
) -> None:
    release = asyncio.Event()

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _, key = await read_command(reader)
        writer.write(b"$10\r\n01234")
        await writer.drain()
        if key == b"drop":
            return  # the connection closes mid-reply
        await release.wait()  # stall, then send the rest after the caller gave up
        writer.write(b"56789\r\n")
        await writer.drain()
        await asyncio.sleep(0.2)

    conn = make_conn(await scripted(script), socket_timeout=0.3)
    dst = memoryview(bytearray(10))
    with pytest.raises(Unavailable, match="lost") as lost:
        await _fast_get(conn, b"drop", dst)
    assert not isinstance(lost.value, Timeout)
    start = time.monotonic()
    with pytest.raises(Timeout, match="no reply"):
        await _fast_get(conn, b"stall", dst)
    assert time.monotonic() - start < 5.0  # 0.3 s, against a stall with no end (room for load)
    task = asyncio.create_task(_fast_get(conn, b"stall", dst))
    await asyncio.sleep(0.05)  # "01234" arrives meanwhile
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    dst[:] = b"x" * 10
    release.set()
    await asyncio.sleep(0.1)
    assert bytes(dst) == b"x" * 10, "bytes arrived in the buffer after the call was over"
