"""The Valkey connector's own behaviour on real servers (beyond the conformance suite).

Server state is inspected with redis-cli, independently of the connector and of glide.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from servers.proc import ServerProcess, free_port, require_binary
from servers.valkey import Certificates, TlsServer, start_tls_server, start_valkey

from connectors.valkey import ValkeyConnector
from gateway.errors import (
    CapacityError,
    ConfigError,
    GatewayError,
    Timeout,
    Unavailable,
)
from gateway.registry import connect
from gateway.store import Store
from gateway.testing import MiB, assert_same_bytes, listed, make_bytes


def _ports(url: str) -> list[int]:
    hosts = url.partition("://")[2].rpartition("@")[2].split("/")[0]
    return [int(h.rpartition(":")[2]) for h in hosts.split(",")]


def redis_cli(port: int, *args: str) -> str:
    cli = require_binary("redis-cli", "apt-get install redis-tools")
    done = subprocess.run(
        [cli, "-c", "-p", str(port), *args], capture_output=True, text=True, check=True
    )
    return done.stdout


def server_keys(url: str, pattern: str) -> dict[int, list[str]]:
    """Keys matching ``pattern`` on each node (SCAN runs per node in a cluster)."""
    return {port: redis_cli(port, "--scan", "--pattern", pattern).split() for port in _ports(url)}


@pytest.fixture
def namespace() -> str:
    return f"kvgate-t-{uuid.uuid4().hex[:8]}:"


@pytest.fixture(params=["standalone", "cluster"])
def any_server(request: pytest.FixtureRequest) -> str:
    name = "valkey_server" if request.param == "standalone" else "valkey_cluster"
    return str(request.getfixturevalue(name))


@pytest_asyncio.fixture
async def conn(any_server: str, namespace: str) -> AsyncIterator[ValkeyConnector]:
    connector = ValkeyConnector.from_url(any_server, namespace=namespace, part_size="4MiB")
    try:
        yield connector
    finally:
        await connector.close()


# -- URLs and options -------------------------------------------------------------------


def test_urls_parse_into_endpoints() -> None:
    one = ValkeyConnector.from_url("valkey://bob:s3cret@db.example:7000/3")
    assert one.endpoint.addresses == (("db.example", 7000),)
    assert one.endpoint.database == 3
    assert one.endpoint.username == "bob"
    assert one.endpoint.password is not None
    assert one.endpoint.password.get_secret_value() == "s3cret"
    assert not one.endpoint.tls
    assert not one.endpoint.cluster
    assert "s3cret" not in repr(one)
    tls = ValkeyConnector.from_url("valkeys://[::1]")
    assert tls.endpoint.addresses == (("::1", 6379),)
    assert tls.endpoint.tls
    cluster = ValkeyConnector.from_url("valkey+cluster://a:1,b:2,[::1]:3", tls=True)
    assert cluster.endpoint.cluster
    assert cluster.endpoint.tls
    assert cluster.endpoint.addresses == (("a", 1), ("b", 2), ("::1", 3))


@pytest.mark.parametrize(
    ("url", "options"),
    [
        ("valkey://a:1,b:2", {}),  # several hosts without +cluster
        ("valkey://h:1?timeout=3", {}),  # options are keywords
        ("valkey://h:99999", {}),
        ("valkey://[::1", {}),
        ("valkey://", {}),
        ("valkey://h/db0", {}),
        ("valkey://:pw@h", {"password": "other"}),
        ("valkey://h", {"tls_ca_file": "/nonexistent"}),  # TLS options without TLS
        ("valkeys://h", {"tls": False}),
        ("valkeys://h", {"tls_insecure": True, "tls_ca_file": "/x"}),
        ("valkeys://h", {"tls_ca_file": "/nonexistent/ca.pem"}),
        ("valkey://h", {"capacity": 1 << 30, "eviction": "lru"}),  # the server evicts
        ("valkey://h", {"part_size": 1024}),
        ("valkey://h", {"request_timeout": 0}),
        ("valkey://h", {"no_such_option": 1}),
        ("redis://h", {}),
    ],
)
def test_bad_urls_and_options_are_config_errors(url: str, options: dict[str, object]) -> None:
    with pytest.raises(ConfigError) as info:
        ValkeyConnector.from_url(url, **options)
    assert "pw" not in str(info.value).replace("password", "")


def test_sizes_accept_units() -> None:
    conn = ValkeyConnector.from_url("valkey://h", part_size="1MiB", inline_max="256KiB")
    assert conn.options.part_size == MiB
    assert conn.options.inline_limit == 256 * 1024


async def test_the_registry_finds_every_scheme(valkey_server: str) -> None:
    for url in (valkey_server, "valkeys://h:1", "valkey+cluster://h:1"):
        made = connect(url)
        assert isinstance(made, ValkeyConnector)
        await made.close()


# -- failures ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def password_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    server = start_valkey(tmp_path_factory.mktemp("valkey-auth"), port, "--requirepass", "Pw-1")
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop()


async def test_wrong_password_is_a_config_error_without_the_password(
    password_server: str,
) -> None:
    for url, options in (
        (f"valkey://:Wrong-Secret-42@{password_server}", {}),
        (f"valkey://{password_server}", {"password": "Wrong-Secret-42"}),
        (f"valkey://{password_server}", {}),  # none given
    ):
        conn = ValkeyConnector.from_url(url, **options)
        try:
            with pytest.raises(ConfigError, match="authentication failed") as info:
                await conn.get("k")
        finally:
            await conn.close()
        assert "Wrong-Secret-42" not in str(info.value)
        assert info.value.__cause__ is None
    good = ValkeyConnector.from_url(f"valkey://:Pw-1@{password_server}")
    try:
        await good.put("k", b"v")
        assert await good.get("k") == b"v"
    finally:
        await good.close()


async def test_no_server_is_unavailable() -> None:
    conn = ValkeyConnector.from_url(f"valkey://127.0.0.1:{free_port()}", connect_timeout=0.5)
    try:
        with pytest.raises(Unavailable):
            await conn.put("k", b"v")
    finally:
        await conn.close()


async def test_a_full_server_is_a_capacity_error_and_leaves_no_parts(
    tmp_path: Path, namespace: str
) -> None:
    port = free_port()
    policy = ["--maxmemory", "16mb", "--maxmemory-policy", "noeviction"]
    server = start_valkey(tmp_path / "full", port, *policy)
    url = f"valkey://127.0.0.1:{port}"
    conn = ValkeyConnector.from_url(url, namespace=namespace, part_size="1MiB", inline_max="64KiB")
    try:
        with pytest.raises(CapacityError):
            await conn.put("big", make_bytes(64 * MiB))
        assert await conn.get("big") is None
        # No main key. Parts whose SET glide had already sent when the put failed can land
        # after the clean-up (cancelling a glide request does not recall it); such parts
        # must still carry their pending expiry, so that they go away by themselves.
        leftovers = server_keys(url, f"{namespace}*")[port]
        assert all(":p:" in key for key in leftovers), leftovers
        for key in leftovers:
            assert int(redis_cli(port, "PTTL", key)) > 0, f"{key} never expires"
        await conn.put("small", b"still works")
        assert await conn.get("small") == b"still works"
    finally:
        await conn.close()
        server.stop()


async def test_a_closed_connector_refuses_calls(valkey_server: str) -> None:
    conn = ValkeyConnector.from_url(valkey_server)
    await conn.ping()
    await conn.close()
    await conn.close()
    with pytest.raises(GatewayError, match="closed"):
        await conn.get("k")


# -- timeouts ---------------------------------------------------------------------------


async def test_32mib_round_trips_with_default_options(valkey_server: str) -> None:
    conn = ValkeyConnector.from_url(valkey_server)
    data = make_bytes(32 * MiB, seed=32)
    try:
        await conn.put("kvgate-test/32mib", data)
        assert_same_bytes(await conn.get("kvgate-test/32mib"), data)
    finally:
        await conn.delete("kvgate-test/32mib")
        await conn.close()


async def test_one_large_request_gets_the_configured_timeout(
    valkey_server: str, namespace: str
) -> None:
    """A 128 MiB value in ONE request (inline): fine with the default request timeout, a
    Timeout with a 50 ms one; glide's own 250 ms default would fail it as well."""
    data = make_bytes(128 * MiB, seed=5)
    inline = {"namespace": namespace, "inline_max": "256MiB"}
    conn = ValkeyConnector.from_url(valkey_server, **inline)
    try:
        await conn.put("one-request", data)
        assert_same_bytes(await conn.get("one-request"), data)
    finally:
        await conn.close()
    hasty = ValkeyConnector.from_url(valkey_server, request_timeout=0.05, **inline)
    try:
        with pytest.raises(Timeout):
            await hasty.get("one-request")
    finally:
        await hasty.delete("one-request")
        await hasty.close()


# -- parts: atomicity and cleanup on the server ----------------------------------------


async def test_a_partial_set_of_parts_is_a_miss(
    conn: ValkeyConnector, any_server: str, namespace: str
) -> None:
    await conn.put("victim", make_bytes(10 * MiB))
    parts = [k for keys in server_keys(any_server, f"{namespace}p:*").values() for k in keys]
    assert len(parts) == 3  # 4 + 4 + 2 MiB
    redis_cli(_ports(any_server)[0], "DEL", parts[1])
    assert await conn.get("victim") is None
    assert await conn.get_into("victim", lambda n: memoryview(bytearray(n))) is None


async def test_overwrites_and_deletes_leave_no_parts_behind(
    conn: ValkeyConnector, any_server: str, namespace: str
) -> None:
    sizes = (9 * MiB, 5 * MiB, 10, 12 * MiB + 1, 3)
    for i, size in enumerate(sizes):
        data = make_bytes(size, seed=i)
        await conn.put("again", data)
        assert_same_bytes(await conn.get("again"), data)
    await conn.put("again", make_bytes(6 * MiB))
    assert await conn.delete("again")
    await conn.put_many([(f"many/{i}", make_bytes(5 * MiB, seed=i)) for i in range(4)])
    for i in range(4):
        await conn.delete(f"many/{i}")
    assert server_keys(any_server, f"{namespace}*") == {port: [] for port in _ports(any_server)}


async def test_committed_parts_do_not_expire(
    conn: ValkeyConnector, any_server: str, namespace: str
) -> None:
    await conn.put("durable", make_bytes(9 * MiB))
    port = _ports(any_server)[0]
    ttls = [
        int(redis_cli(port, "PTTL", key))
        for keys in server_keys(any_server, f"{namespace}*").values()
        for key in keys
    ]
    assert ttls == [-1] * 4  # the main key and three parts


async def test_ttl_expires_objects_with_their_parts(any_server: str, namespace: str) -> None:
    # 3 s, not 1: a loaded machine can take a second between the puts and the PTTL check.
    conn = ValkeyConnector.from_url(any_server, namespace=namespace, ttl=3.0)
    try:
        await conn.put("fleeting", make_bytes(9 * MiB))
        await conn.put("small", b"x")
        port = _ports(any_server)[0]
        main_ttl = int(redis_cli(port, "PTTL", f"{namespace}o:fleeting"))
        assert 0 < main_ttl <= 3000
        parts = [k for ks in server_keys(any_server, f"{namespace}p:*").values() for k in ks]
        assert all(int(redis_cli(port, "PTTL", k)) > main_ttl for k in parts)
        await asyncio.sleep(3.2)
        assert await conn.get("fleeting") is None
        assert await conn.get("small") is None
    finally:
        await conn.close()


async def test_cluster_parts_spread_over_the_nodes(valkey_cluster: str, namespace: str) -> None:
    conn = ValkeyConnector.from_url(valkey_cluster, namespace=namespace, part_size="1MiB")
    try:
        data = make_bytes(48 * MiB, seed=48)
        await conn.put("spread", data)
        per_node = server_keys(valkey_cluster, f"{namespace}p:*")
        assert sum(len(k) for k in per_node.values()) == 48
        assert all(per_node.values()), (
            f"a node holds no part: { {p: len(k) for p, k in per_node.items()} }"
        )
        assert_same_bytes(await conn.get("spread"), data)
    finally:
        await conn.delete("spread")
        await conn.close()


@pytest.mark.parametrize("size", [1, 64 * 1024, 64 * 1024 + 1, MiB + 3])
async def test_small_parts_from_scatter_lists(any_server: str, namespace: str, size: int) -> None:
    conn = ValkeyConnector.from_url(
        any_server, namespace=namespace, part_size="64KiB", inline_max=0
    )
    data = make_bytes(size, seed=size)
    cut = min(7, size // 2)
    pieces = [data[:cut], bytearray(data[cut : size // 2]), memoryview(data)[size // 2 :]]
    try:
        await conn.put("scattered", pieces)
        assert_same_bytes(await conn.get("scattered"), data)
        slab = bytearray(size)
        got = await conn.get_into("scattered", lambda n: memoryview(slab))
        assert got is not None
        assert_same_bytes(slab, data)
    finally:
        await conn.delete("scattered")
        await conn.close()


# -- listing ----------------------------------------------------------------------------


async def test_list_treats_glob_characters_literally(conn: ValkeyConnector) -> None:
    names = ["a*b", "a?c", "a[x]", "a\\d", "aXb", "a*", "b"]
    for i, name in enumerate(names):
        await conn.put(name, b"v" * i)
    await conn.put("a*big", make_bytes(5 * MiB))
    assert await listed(conn, "a*") == {"a*b": 0, "a*": 5, "a*big": 5 * MiB}
    assert await listed(conn, "a[") == {"a[x]": 2}
    assert await listed(conn, "a\\") == {"a\\d": 3}
    assert await listed(conn, "a?") == {"a?c": 1}
    assert len(await listed(conn, "")) == len(names) + 1


# -- TLS --------------------------------------------------------------------------------


async def test_tls_needs_the_servers_ca(valkey_tls_server: TlsServer) -> None:
    url = valkey_tls_server.url
    trusted = ValkeyConnector.from_url(url, tls_ca_file=str(valkey_tls_server.certs.ca))
    insecure = ValkeyConnector.from_url(url, tls_insecure=True)
    untrusted = ValkeyConnector.from_url(url, connect_timeout=1.0)  # the system's trust store
    plain = ValkeyConnector.from_url(url.replace("valkeys", "valkey"), connect_timeout=1.0)
    try:
        assert await trusted.ping()
        assert await insecure.ping()
        with pytest.raises(Unavailable):
            await untrusted.ping()
        with pytest.raises(Unavailable):
            await plain.ping()
    finally:
        for c in (trusted, insecure, untrusted, plain):
            await c.close()


async def test_mutual_tls_presents_the_client_certificate(
    tmp_path: Path, valkey_tls_certs: Certificates
) -> None:
    server = start_tls_server(tmp_path / "mtls", valkey_tls_certs, client_certs=True)
    certs = valkey_tls_certs
    with_cert = ValkeyConnector.from_url(
        server.url,
        tls_ca_file=str(certs.ca),
        tls_cert_file=str(certs.client_cert),
        tls_key_file=str(certs.client_key),
    )
    without = ValkeyConnector.from_url(server.url, tls_ca_file=str(certs.ca), connect_timeout=1.0)
    try:
        await with_cert.put("k", b"mutual")
        assert await with_cert.get("k") == b"mutual"
        with pytest.raises(Unavailable):
            await without.ping()
    finally:
        await with_cert.close()
        await without.close()
        server.process.stop()


# -- through a Store, and the baseline --------------------------------------------------


async def test_store_tier_from_config(valkey_server: str, namespace: str) -> None:
    cfg = {"tiers": [{"url": valkey_server, "timeout": 30.0, "options": {"namespace": namespace}}]}
    async with Store(cfg) as store:
        await store.put("chunk", make_bytes(6 * MiB, seed=6))
        await store.flush()
        assert_same_bytes(await store.get("chunk"), make_bytes(6 * MiB, seed=6))


async def test_raw_client_baseline_measures_and_cleans_up(any_server: str) -> None:
    put_gbps, get_gbps = await ValkeyConnector.raw_client_baseline(
        any_server,
        {},
        size=MiB,
        count=4,
        concurrency=2,
        payloads=[bytes([i]) * MiB for i in range(3)],
    )
    assert put_gbps > 0
    assert get_gbps > 0
    assert server_keys(any_server, "kvgate-baseline/*") == {port: [] for port in _ports(any_server)}


async def test_server_restart_is_survived(tmp_path: Path, namespace: str) -> None:
    """Killed and restarted on the same port: calls fail as Unavailable/Timeout (never hang
    past request_timeout), then work again without a new connector."""
    port = free_port()
    server: ServerProcess = start_valkey(tmp_path / "restart", port)
    conn = ValkeyConnector.from_url(
        f"valkey://127.0.0.1:{port}", namespace=namespace, request_timeout=2.0
    )
    try:
        await conn.put("k", b"before")
        server.kill()
        start = time.monotonic()
        with pytest.raises(Unavailable):
            await conn.get("k")
        assert time.monotonic() - start < 5.0
        server.start()
        deadline = time.monotonic() + 10.0
        while True:
            try:
                await conn.put("k", b"after")
                break
            except Unavailable:
                assert time.monotonic() < deadline, "the connector never came back"
                await asyncio.sleep(0.2)
        assert await conn.get("k") == b"after"
    finally:
        await conn.close()
        server.stop()


class LoopStall:
    """The longest the event loop went without running a 10 ms ticker, while in the block."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            self.worst = max(self.worst, now - last - 0.01)
            last = now

    async def __aenter__(self) -> LoopStall:
        self._task = asyncio.ensure_future(self._tick())
        await asyncio.sleep(0.02)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


@pytest.mark.both_loops
@pytest.mark.parametrize("down", ["stopped", "refused"])
async def test_a_server_that_does_not_answer_never_holds_the_event_loop(
    tmp_path: Path, namespace: str, down: str
) -> None:
    """glide connects inside a blocking native call: with the server stopped (SIGSTOP: the
    kernel still accepts) every get and put of the process, memory tier too, froze for
    ``connect_timeout`` per client on each try. Now the calls fail within the tier's
    timeout (refused: at once) and the memory tier answers meanwhile."""
    port = free_port()
    server: ServerProcess = start_valkey(tmp_path / "stopped", port)
    config = {
        "prefault": False,
        "tiers": [
            {"url": "memory://", "capacity": "16MiB"},
            {
                "url": f"valkey://127.0.0.1:{port}",
                "options": {"namespace": namespace},
                "timeout": 2.0,
            },
        ],
    }
    try:
        if down == "refused":
            server.stop()
        async with Store(config) as store, LoopStall() as stall:
            await store.put("in-memory", b"m" * 4096)
            with server.paused() if down == "stopped" else contextlib.nullcontext():
                for _ in range(2):  # a second try connects again
                    start = time.monotonic()
                    assert await store.get("absent") is None
                    took = time.monotonic() - start
                    assert took < (2.5 if down == "stopped" else 0.5), took
                    assert await store.get("in-memory") == b"m" * 4096
            assert stall.worst < 0.5, f"the loop stalled {stall.worst:.2f} s"
    finally:
        server.stop()


async def test_parts_left_by_a_failed_removal_are_removed_after_the_next_commit(
    tmp_path: Path, namespace: str
) -> None:
    """An overwrite's removal of the replaced object's parts can fail (a connection reset
    part-way, here an ACL without DEL): those parts have no TTL any more, and were left on the
    server for ever. They are kept and removed once removals work again."""
    port = free_port()
    server: ServerProcess = start_valkey(tmp_path / "acl", port)
    redis_cli(port, "ACL", "SETUSER", "writer", "on", ">Pw-2", "~*", "+@all", "-del", "-unlink")
    url = f"valkey://writer:Pw-2@127.0.0.1:{port}"
    conn = ValkeyConnector.from_url(url, namespace=namespace, part_size="1MiB", inline_max="64KiB")
    try:
        first, second, third = (make_bytes(3 * MiB + 5, seed=s) for s in (1, 2, 3))
        await conn.put("k", first)
        await conn.put("k", second)  # the first object's parts stay: no DEL
        with pytest.raises(ConfigError, match="ACL refuses"):  # not Unavailable, retried
            await conn.delete("k")
        assert len(redis_cli(port, "--scan", "--pattern", f"{namespace}*").split()) == 1 + 2 * 4
        redis_cli(port, "ACL", "SETUSER", "writer", "+del", "+unlink")
        await conn.put("k", third)  # removes the second object's parts, and the first's
        assert len(redis_cli(port, "--scan", "--pattern", f"{namespace}*").split()) == 1 + 4
        assert_same_bytes(await conn.get("k"), third)
    finally:
        await conn.close()
        server.stop()
