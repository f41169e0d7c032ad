"""What only gateway:// does, on real kvgate services: one gateway as a tier of another,
frames on the wire, auth, TLS, and the error map (refused, timeout, 413, 5xx)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from servers.gateway_server import GatewayServer, gateway_server_at, start_gateway
from servers.proc import free_port
from servers.tls import make_certificates

from connectors.gateway import GatewayConnector
from connectors.gateway.wire import OPAQUE
from gateway.errors import CapacityError, ConfigError, IncompleteDelete, Timeout, Unavailable
from gateway.store import Store

# Transports differ between asyncio's loop and uvloop (what `kvgate serve` runs on).
pytestmark = pytest.mark.both_loops

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    yield from gateway_server_at(tmp_path_factory.mktemp("gw"), max_object_size="1MiB")


def lower_store(server: GatewayServer, **options: object) -> Store:
    cfg = {
        "tiers": [
            {"url": "memory://", "capacity": "64MiB"},
            {"url": server.url, "timeout": 10.0, "codec": "zstd", "options": options},
        ],
        "prefault": False,
    }
    return Store(cfg, connectors={1: GatewayConnector.from_url(server.url, **options)})


async def test_a_gateway_is_a_tier_of_another(server: GatewayServer) -> None:
    src = torch.arange(2 * 4 * 16 * 8, dtype=torch.float32).reshape(2, 4, 16, 8).to(torch.bfloat16)
    async with lower_store(server) as store:
        await store.put("tier/t", src, fmt=1)
        await store.put("tier/b", b"plain bytes")
        await store.flush()
    # The remote holds real objects (decoded from the zstd frames), not opaque blobs.
    async with httpx.AsyncClient(base_url=server.http_url) as http:
        got = await http.get("/v1/objects/tier%2Ft")
        assert got.headers["x-kvgate-dtype"] == "bfloat16"
        assert got.headers["x-kvgate-shape"] == "2,4,16,8"
        assert got.content == src.view(torch.uint8).numpy().tobytes()
        assert (await http.get("/v1/objects/tier%2Fb")).content == b"plain bytes"
    # A new store (empty memory tier) reads both back through the gateway, zstd on the wire.
    async with lower_store(server, codec="zstd") as store:
        back = await store.get("tier/t")
        assert isinstance(back, torch.Tensor)
        assert back.dtype == torch.bfloat16
        assert torch.equal(back, src)
        assert await store.get("tier/b") == b"plain bytes"
        assert await store.lookup(["tier/t", "tier/b", "tier/none"]) == 2


async def test_opaque_bytes_and_corrupt_frames_keep_their_bytes(server: GatewayServer) -> None:
    async with GatewayConnector.from_url(server.url) as conn:
        await conn.put("opaque", b"KVGF but not a frame")
        assert bytes(await conn.get("opaque") or b"") == b"KVGF but not a frame"
        async with httpx.AsyncClient(base_url=server.http_url) as http:
            assert (
                await http.get("/v1/objects/opaque")
            ).content == OPAQUE + b"KVGF but not a frame"


async def test_the_413_of_the_remote_is_a_capacity_error(server: GatewayServer) -> None:
    async with GatewayConnector.from_url(server.url) as conn:
        with pytest.raises(CapacityError, match="413"):
            await conn.put("too-big", bytes(2 << 20))


async def test_a_remote_whose_lower_tier_fails_deletes_stays_in_use(tmp_path: Path) -> None:
    # The remote is up: a delete its Redis tier failed is an error of that delete, and
    # counts toward none of the client's breaker (5 failures), so puts and gets go on.
    down = {"url": f"redis://127.0.0.1:{free_port()}", "timeout": 1.0}  # nothing listens
    for server in gateway_server_at(tmp_path, lower_tiers=(down,)):
        async with lower_store(server) as store:
            for i in range(8):
                await store.put(f"d{i}", b"x" * 100)
                await store.flush()  # the remote's own put returns before its Redis write
                with pytest.raises(IncompleteDelete, match="may still be in tier gateway"):
                    await store.delete(f"d{i}")
            await store.put("after", b"still served")
            await store.flush()
            assert store.stats()["gateway"].errors == {"incomplete_delete": 8}  # nothing else
        async with lower_store(server) as store:  # a new memory tier: read from the remote
            assert await store.get("after") == b"still served"


async def test_token_is_required_and_never_shown(tmp_path: Path) -> None:
    secret = "s3cr3t-token-value"
    server = start_gateway(tmp_path, token=secret)
    try:
        async with GatewayConnector.from_url(server.url) as anonymous:
            with pytest.raises(ConfigError) as caught:
                await anonymous.get("k")
            assert server.url.split("://")[1] in str(caught.value)
            assert "401" in str(caught.value)
        async with GatewayConnector.from_url(server.url, token="wrong") as wrong:
            with pytest.raises(ConfigError):
                await wrong.put("k", b"v")
        conn = GatewayConnector.from_url(server.url, token=secret)
        async with conn:
            await conn.put("k", b"v")
            assert bytes(await conn.get("k") or b"") == b"v"
            assert secret not in repr(conn)
            assert secret not in repr(conn.options)
    finally:
        server.process.stop()


async def test_gateways_over_tls_with_a_ca_bundle(tmp_path: Path) -> None:
    certs = make_certificates(tmp_path / "certs")
    server = start_gateway(tmp_path, certfile=certs.server_cert, keyfile=certs.server_key)
    url = f"gateways://127.0.0.1:{server.port}"
    try:
        async with GatewayConnector.from_url(url, ca_bundle=str(certs.ca)) as conn:
            await conn.put("tls", b"over https")
            assert bytes(await conn.get("tls") or b"") == b"over https"
            assert await conn.ping()
        async with GatewayConnector.from_url(url) as untrusted:  # the system CAs only
            with pytest.raises(Unavailable, match="ConnectError"):
                await untrusted.get("tls")
    finally:
        server.process.stop()


async def test_nothing_listening_is_unavailable() -> None:
    async with GatewayConnector.from_url(f"gateway://127.0.0.1:{free_port()}") as conn:
        with pytest.raises(Unavailable, match="ConnectError"):
            await conn.get("k")
        with pytest.raises(Unavailable):
            await conn.put("k", b"v")
        with pytest.raises(Unavailable):
            await conn.exists_many(["k", "j"])


async def _raw_server(answer: bytes | None) -> AsyncIterator[int]:
    """A socket that reads a request and answers ``answer`` (None: never answers)."""
    writers: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        await reader.readuntil(b"\r\n\r\n")
        if answer is not None:
            writer.write(answer)
            await writer.drain()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        async with server:
            yield server.sockets[0].getsockname()[1]
    finally:
        for writer in writers:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


@pytest.fixture
async def silent_port() -> AsyncIterator[int]:
    async for port in _raw_server(None):
        yield port


async def test_a_silent_server_is_a_timeout(silent_port: int) -> None:
    conn = GatewayConnector.from_url(f"gateway://127.0.0.1:{silent_port}", timeout=0.3)
    start = time.monotonic()
    with pytest.raises(Timeout):
        await conn.get("k")
    assert time.monotonic() - start < 5.0  # 0.3 s, against a silence with no end (room for load)
    with pytest.raises(Timeout):
        await conn.exists_many(["k", "j"])
    await conn.close()


async def test_exists_many_of_a_remote_without_the_route_asks_per_key() -> None:
    """An older kvgate has no POST /v1/exists (404): HEADs answer instead, from then on."""
    seen: list[bytes] = []
    writers: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line = head.split(b"\r\n", 1)[0]
                seen.append(line)
                length = re.search(rb"(?i)content-length: *(\d+)", head)
                await reader.readexactly(int(length[1]) if length else 0)
                if line.startswith(b"POST"):
                    body = b'{"detail": "Not Found"}'
                    writer.write(
                        b"HTTP/1.1 404 Not Found\r\ncontent-length: %d\r\n\r\n" % len(body) + body
                    )
                else:  # HEAD: "there" is stored, nothing else
                    status = b"200 OK" if b"there" in line else b"404 Not Found"
                    writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-length: 0\r\n\r\n")
                await writer.drain()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        async with server:
            port = server.sockets[0].getsockname()[1]
            async with GatewayConnector.from_url(f"gateway://127.0.0.1:{port}") as conn:
                assert await conn.exists_many(["there", "not", "there"]) == [True, False, True]
                assert await conn.exists_many(["not", "there"]) == [False, True]
    finally:
        for writer in writers:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
    posts = [line for line in seen if line.startswith(b"POST")]
    assert posts == [b"POST /v1/exists HTTP/1.1"]  # asked once, then HEADs only


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (b'{"error": "unavailable", "detail": "redis is down"}', Unavailable),
        (b"<html>bad gateway</html>", Unavailable),
    ],
)
async def test_5xx_answers_are_unavailable(answer: bytes, error: type[Exception]) -> None:
    status = b"503 Service Unavailable" if answer.startswith(b"{") else b"502 Bad Gateway"
    raw = b"HTTP/1.1 " + status + b"\r\ncontent-length: %d\r\n\r\n%s" % (len(answer), answer)
    async for port in _raw_server(raw):
        async with GatewayConnector.from_url(f"gateway://127.0.0.1:{port}") as conn:
            with pytest.raises(error, match="HTTP 50"):
                await conn.get("k")


@pytest.mark.parametrize(
    ("url", "options", "match"),
    [
        ("gateway://user:pw@h:1", {}, "token"),
        ("gateway://h:1/path", {}, "no path"),
        ("gateway://h:1", {"tokn": "x"}, "'tokn'"),
        ("gateway://h:1", {"ca_bundle": "/ca.pem"}, "gateways://"),
        ("http://h:1", {}, "not a gateway"),
        ("gateway://h:1?timeout=3", {}, "keyword"),
    ],
)
def test_bad_urls_and_options(url: str, options: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        GatewayConnector.from_url(url, **options)


def test_default_port_and_scheme() -> None:
    conn = GatewayConnector.from_url("gateways://example.org", verify_tls=False)
    assert conn.endpoint.base_url == "https://example.org:8080"
    assert conn.scheme == "gateways"
    assert not conn.capabilities.list
