"""aesgcm through a Store on every kind of tier: memory:// (as a lower tier), file://, a real
redis-server and another kvgate (gateway://). Objects round-trip; the backend holds only
ciphertext; a byte flipped in the stored object, or a store with another key, is a miss that
the tier counts; rotation keeps old objects readable.

Each test writes with one Store and reads with a fresh one (an empty memory L1), so every read
comes from the tier under test.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from keyed_codecs import OTHER_KEY, SHARED_KEY, tier_codec, write_key_file
from servers.gateway_server import GatewayServer, gateway_server_at
from servers.redis import RedisNode

from gateway.connector import Connector
from gateway.frame import decode_frame, encode_header
from gateway.registry import connect
from gateway.store import Store
from serde.aes_keys import key_id

torch = pytest.importorskip("torch")
pytest.importorskip("cryptography")

BACKENDS = ["memory", "file", "redis", "gateway"]
SPECS = ["aesgcm", "bytesplit+aesgcm", "fp8+aesgcm"]
MARKER = b"PLAINTEXT-MARKER-"
NEW_KEY = bytes(range(200, 232))


@pytest.fixture(scope="module")
def gateway_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    yield from gateway_server_at(tmp_path_factory.mktemp("gw"), max_object_size="64MiB")


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URL of a fresh space on the backend (every test uses its own keys there too)."""
    kind = request.param
    if kind == "memory":
        return f"memory://aes-{uuid.uuid4().hex}"
    if kind == "file":
        return f"file://{tmp_path / 'disk'}"
    if kind == "redis":
        node: RedisNode = request.getfixturevalue("redis_server")
        return node.url
    server: GatewayServer = request.getfixturevalue("gateway_server")
    return server.url


def store(url: str, spec: str, key_file: str) -> Store:
    return Store(
        {
            "tiers": [
                {"url": "memory://", "capacity": "64MiB"},
                {"url": url, "timeout": 10.0, **tier_codec(spec, key_file)},
            ],
            "prefault": False,
            "staging": 32 << 20,
        }
    )


def kv() -> Any:
    g = torch.Generator().manual_seed(0)
    return torch.randn((2, 3, 40, 64), generator=g).to(torch.float16)


def same(got: object, src: Any, spec: str) -> bool:
    if not isinstance(got, torch.Tensor) or got.shape != src.shape or got.dtype != src.dtype:
        return False
    if spec.startswith("fp8"):
        return bool(torch.allclose(got.float(), src.float(), rtol=0.07, atol=0.02))
    return bool(torch.equal(got.view(torch.uint8), src.view(torch.uint8)))


def corrupt_count(s: Store) -> int:
    return s.tiers[0].stats.corrupt


async def stored_blob(url: str, key: str) -> bytes | None:
    """The frame the tier wrote, read around the store."""
    conn: Connector = connect(url)
    try:
        blob = await conn.get(key)
        return None if blob is None else bytes(memoryview(blob))
    finally:
        await conn.close()


async def forge_flip(url: str, key: str, offset_from_end: int) -> None:
    """Flip one payload byte of the stored frame and make the frame's checksums right again,
    as anyone who can write to the backend can: only the cipher can notice."""
    blob = await stored_blob(url, key)
    assert blob is not None
    header, body = decode_frame(blob)
    payload = bytearray(body)
    payload[len(payload) - offset_from_end] ^= 0x01
    head, _ = encode_header(
        codec=header.codec,
        kind=header.kind,
        dtype=header.dtype,
        shape=header.shape,
        raw_len=header.raw_len,
        payload=bytes(payload),
        fmt=header.fmt,
        params=header.params,
        key=key,
    )
    conn = connect(url)
    try:
        await conn.put(key, [head, bytes(payload)])
    finally:
        await conn.close()


@pytest.mark.parametrize("spec", SPECS)
async def test_round_trip_and_only_ciphertext_at_rest(
    backend: str, spec: str, tmp_path: Path
) -> None:
    keys = write_key_file(tmp_path / "keys", SHARED_KEY)
    k_tensor, k_bytes = f"aes/{uuid.uuid4().hex}/t", f"aes/{uuid.uuid4().hex}/b"
    src = kv()
    async with store(backend, spec, keys) as writer:
        await writer.put(k_tensor, src, fmt=1)
        await writer.put(k_bytes, MARKER * 500)
        await writer.flush()
    blob = await stored_blob(backend, k_bytes)
    assert blob is not None
    assert MARKER not in blob
    header, _ = decode_frame(blob)
    assert header.codec == spec
    assert key_id(SHARED_KEY) in header.params.values()
    async with store(backend, spec, keys) as reader:
        assert same(await reader.get(k_tensor), src, spec)
        assert await reader.get(k_bytes) == MARKER * 500
        assert corrupt_count(reader) == 0


@pytest.mark.parametrize("spec", ["aesgcm", "bytesplit+aesgcm"])
async def test_a_tampered_object_is_a_counted_miss(backend: str, spec: str, tmp_path: Path) -> None:
    keys = write_key_file(tmp_path / "keys", SHARED_KEY)
    names = [f"aes/{uuid.uuid4().hex}/{i}" for i in range(3)]
    async with store(backend, spec, keys) as writer:
        for name in names:
            await writer.put(name, kv(), fmt=1)
        await writer.flush()
    # a ciphertext byte, the last byte of the tag, and the first byte of the salt
    for name, at in zip(names, (1000, 1, 10**9), strict=True):
        blob = await stored_blob(backend, name)
        assert blob is not None
        await forge_flip(backend, name, min(at, decode_frame(blob)[1].nbytes))
    async with store(backend, spec, keys) as reader:
        for count, name in enumerate(names, 1):
            assert await reader.get(name) is None
            assert corrupt_count(reader) == count
    assert await stored_blob(backend, names[0]) is None  # tampered objects are dropped


async def test_bytes_flipped_on_disk_and_in_redis_are_counted_misses(
    tmp_path: Path, redis_server: RedisNode
) -> None:
    keys = write_key_file(tmp_path / "keys", SHARED_KEY)
    name = f"aes/{uuid.uuid4().hex}"
    disk = tmp_path / "disk"
    for url in (f"file://{disk}", redis_server.url):
        async with store(url, "aesgcm", keys) as writer:
            await writer.put(name, kv(), fmt=1)
            await writer.flush()
        if url.startswith("file"):
            (path,) = [p for p in disk.rglob("*") if p.is_file() and p.read_bytes()[:4] == b"KVGD"]
            data = bytearray(path.read_bytes())
            data[-100] ^= 0x80
            path.write_bytes(bytes(data))
        else:
            client = redis_server.client()
            (stored,) = list(client.scan_iter(match=f"*{name}*"))
            size = client.strlen(stored)
            byte = client.getrange(stored, size - 100, size - 100)
            client.setrange(stored, size - 100, bytes([byte[0] ^ 0x80]))
            client.close()
        async with store(url, "aesgcm", keys) as reader:
            assert await reader.get(name) is None
            assert corrupt_count(reader) == 1


@pytest.mark.parametrize("spec", ["aesgcm", "fp8+aesgcm"])
async def test_another_key_is_a_counted_miss_and_leaves_the_object(
    backend: str, spec: str, tmp_path: Path
) -> None:
    keys = write_key_file(tmp_path / "keys", SHARED_KEY)
    other = write_key_file(tmp_path / "other", OTHER_KEY)
    name = f"aes/{uuid.uuid4().hex}"
    src = kv()
    async with store(backend, spec, keys) as writer:
        await writer.put(name, src, fmt=1)
        await writer.flush()
    async with store(backend, spec, other) as stranger:
        assert await stranger.get(name) is None
        assert await stranger.get(name) is None
        assert corrupt_count(stranger) == 2
    # left in the backend for readers that hold the key
    async with store(backend, spec, keys) as reader:
        assert same(await reader.get(name), src, spec)


async def test_a_store_without_keys_reads_encrypted_objects_as_misses(
    backend: str, tmp_path: Path
) -> None:
    keys = write_key_file(tmp_path / "keys", SHARED_KEY)
    name = f"aes/{uuid.uuid4().hex}"
    async with store(backend, "aesgcm", keys) as writer:
        await writer.put(name, b"secret bytes")
        await writer.flush()
    plain = Store(
        {"tiers": [{"url": "memory://"}, {"url": backend, "codec": "zstd"}], "prefault": False}
    )
    async with plain:
        assert await plain.get(name) is None
        assert corrupt_count(plain) == 1
    async with store(backend, "aesgcm", keys) as reader:
        assert await reader.get(name) == b"secret bytes"


async def test_rotation(backend: str, tmp_path: Path) -> None:
    old = write_key_file(tmp_path / "old", SHARED_KEY)
    rotated = write_key_file(tmp_path / "rotated", NEW_KEY, SHARED_KEY)
    before, after = f"aes/{uuid.uuid4().hex}/before", f"aes/{uuid.uuid4().hex}/after"
    async with store(backend, "bytesplit+aesgcm", old) as writer:
        await writer.put(before, b"written with the old key")
        await writer.flush()
    async with store(backend, "bytesplit+aesgcm", rotated) as writer:
        assert await writer.get(before) == b"written with the old key"
        await writer.put(after, b"written with the new key")
        await writer.flush()
    blob = await stored_blob(backend, after)
    assert blob is not None
    assert decode_frame(blob)[0].params["1.kid"] == key_id(NEW_KEY)
    async with store(backend, "bytesplit+aesgcm", old) as lagging:
        assert await lagging.get(before) == b"written with the old key"
        assert await lagging.get(after) is None
        assert corrupt_count(lagging) == 1


async def test_a_remote_gateway_never_sees_the_plaintext(
    gateway_server: GatewayServer, tmp_path: Path
) -> None:
    import httpx

    from connectors.gateway.wire import OPAQUE

    keys = write_key_file(tmp_path / "keys", SHARED_KEY)
    name = f"aes-{uuid.uuid4().hex}"
    async with store(gateway_server.url, "aesgcm", keys) as writer:
        await writer.put(name, MARKER * 100)
        await writer.flush()
    async with httpx.AsyncClient(base_url=gateway_server.http_url) as http:
        held = await http.get(f"/v1/objects/{name}")
    assert held.status_code == 200
    assert held.content.startswith(OPAQUE)  # refused as a frame: kept as opaque bytes
    assert MARKER not in held.content
