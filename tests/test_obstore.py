"""obstore+s3:// beyond the conformance suite, against a real SeaweedFS server.

Options and secrets, refused credentials and a missing bucket, objects shared with s3:// (the
same names and metadata), long keys, the caller's buffer and the reader's limit, multipart
uploads when asked for, a stalled and a stopped server, and the benchmark's baseline.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from servers.proc import free_port
from servers.s3 import S3Server, raw_s3, tcp_proxy

from connectors.obstore import ObstoreS3Connector
from connectors.s3 import S3Connector
from gateway.connector import limiting_reads
from gateway.errors import ConfigError, CorruptObject, InvalidKey, Timeout, Unavailable
from gateway.registry import connect
from gateway.store import Store
from gateway.testing import assert_same_bytes, listed, make_bytes

MiB = 1 << 20


@pytest.fixture
def prefix() -> str:
    return f"test-{uuid.uuid4().hex[:10]}"


def obstore_connector(server: S3Server, prefix: str, **options: Any) -> ObstoreS3Connector:
    url = f"obstore+s3://{server.bucket}/{prefix}"
    return ObstoreS3Connector.from_url(url, **server.options(**options))


# -- options and URLs --------------------------------------------------------------------------


def test_url_and_options_are_checked() -> None:
    conn = connect("obstore+s3://bucket/a/b", endpoint_url="http://127.0.0.1:9")
    assert isinstance(conn, ObstoreS3Connector)
    assert (conn.bucket, conn.prefix) == ("bucket", "a/b/")
    bad: list[tuple[str, dict[str, Any]]] = [
        ("obstore+s3://bucket/p", {"no_such_option": 1}),
        ("obstore+s3://bucket/p", {"access_key_id": "only-the-id"}),
        ("obstore+s3://bucket/p", {"part_size": MiB}),  # S3 refuses parts under 5 MiB
        ("obstore+s3://bucket/p", {"endpoint_url": "ftp://host"}),
        ("obstore+s3://user:pw@bucket/p", {}),
        ("obstore+s3://b/p", {}),  # bucket name too short
        ("obstore+s3://bucket/a/../b", {}),
        ("obstore+s3://bucket/p?region=x", {}),
        ("s3://bucket/p", {}),
    ]
    for url, options in bad:
        with pytest.raises(ConfigError):
            ObstoreS3Connector.from_url(url, **options)
    sizes = ObstoreS3Connector.from_url("obstore+s3://bucket", multipart_threshold="64MiB")
    assert sizes.options.multipart_threshold == 64 * MiB


def test_repr_and_errors_hide_the_secret() -> None:
    secret = f"s3cr3t-{uuid.uuid4().hex}"
    conn = ObstoreS3Connector.from_url(
        "obstore+s3://bucket/p", access_key_id="AKID", secret_access_key=secret
    )
    assert secret not in repr(conn)
    assert secret not in repr(conn.options)
    assert secret not in str(conn.options)
    with pytest.raises(ConfigError) as err:
        ObstoreS3Connector.from_url("obstore+s3://bucket/p", secret_access_key=secret, bogus=1)
    assert secret not in str(err.value)


# -- credentials and buckets -------------------------------------------------------------------


@pytest.mark.parametrize("check_bucket", [True, False], ids=["checked", "unchecked"])
async def test_wrong_credentials_are_a_clear_config_error(
    s3_server: S3Server, prefix: str, check_bucket: bool
) -> None:
    bogus = f"wrong-{uuid.uuid4().hex}"
    conn = obstore_connector(s3_server, prefix, check_bucket=check_bucket, secret_access_key=bogus)
    calls = {
        "get": lambda: conn.get("k"),
        "put": lambda: conn.put("k", b"v"),
        "exists": lambda: conn.exists("k"),
        "list": lambda: listed(conn, ""),
    }
    try:
        for op, call in calls.items():
            with pytest.raises(ConfigError) as err:
                await call()
            message = str(err.value)
            assert "credentials" in message, f"{op}: {message}"
            assert s3_server.bucket in message
            assert bogus not in message, op
            assert s3_server.secret_key not in message, op
    finally:
        await conn.close()


async def test_a_missing_bucket_is_named_not_a_miss(s3_server: S3Server) -> None:
    bucket = f"kvgate-missing-{uuid.uuid4().hex[:8]}"
    for check in (True, False):
        conn = ObstoreS3Connector.from_url(
            f"obstore+s3://{bucket}/p", **s3_server.options(check_bucket=check)
        )
        try:
            with pytest.raises(ConfigError, match=bucket):
                await conn.get("k")  # a 404 that is not a missing object
        finally:
            await conn.close()


async def test_credentials_come_from_the_aws_environment(
    s3_server: S3Server, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    options = s3_server.options()
    del options["access_key_id"], options["secret_access_key"]
    conn = ObstoreS3Connector.from_url(f"obstore+s3://{s3_server.bucket}/{prefix}", **options)
    try:
        await conn.put("k", b"from the environment")
        assert bytes(await conn.get("k") or b"") == b"from the environment"
    finally:
        await conn.close()


# -- objects shared with s3:// -----------------------------------------------------------------


async def test_objects_are_shared_with_s3(s3_server: S3Server, prefix: str) -> None:
    """The same names and metadata: either connector reads and lists the other's objects,
    long (hashed) keys included, so a deployment can switch without moving data."""
    ob = obstore_connector(s3_server, prefix)
    s3 = S3Connector.from_url(s3_server.url(prefix), **s3_server.options())
    long_key = "ü" * 300 + "/" + "k" * 700  # over a 1024-byte name: hashed, key in metadata
    try:
        await ob.put("from/obstore", b"one")
        await ob.put(long_key + "o", b"two")
        await s3.put("from/s3", b"three")
        await s3.put(long_key + "s", b"four")
        expected = {"from/obstore": 3, long_key + "o": 3, "from/s3": 5, long_key + "s": 4}
        assert await listed(ob, "") == expected
        assert await listed(s3, "") == expected
        assert await listed(ob, "from/") == {"from/obstore": 3, "from/s3": 5}
        assert bytes(await ob.get("from/s3") or b"") == b"three"
        assert bytes(await ob.get(long_key + "s") or b"") == b"four"
        assert bytes(await s3.get("from/obstore") or b"") == b"one"
        assert bytes(await s3.get(long_key + "o") or b"") == b"two"
    finally:
        await ob.close()
        await s3.close()


async def test_long_keys_and_foreign_objects(s3_server: S3Server, prefix: str) -> None:
    conn = obstore_connector(s3_server, prefix)
    stem = "ü" * 300 + "/" + "k" * 700
    keys = [f"{stem}{tail}" for tail in ("a", "b", "ab", "🔑")]
    try:
        for i, key in enumerate(keys):
            await conn.put(key, f"value {i}".encode())
        async with raw_s3(s3_server) as s3:
            for name in ("foreign.txt", "sub/x", "bad!" + "0" * 40):
                await s3.put_object(Bucket=s3_server.bucket, Key=f"{prefix}/{name}", Body=b"?")
        assert await listed(conn, "") == {k: len(f"value {i}") for i, k in enumerate(keys)}
        assert await listed(conn, stem + "a") == {keys[0]: 7, keys[2]: 7}
        assert await conn.delete(keys[0])
        assert not await conn.exists(keys[0])
        too_long = "x" * 1501
        with pytest.raises(InvalidKey):
            await conn.put(too_long, b"v")
        assert await conn.get(too_long) is None
        assert await conn.delete(too_long) is False
    finally:
        await conn.close()


# -- buffers, limits, multipart ----------------------------------------------------------------


async def test_get_into_fills_the_callers_buffer(s3_server: S3Server, prefix: str) -> None:
    conn = obstore_connector(s3_server, prefix)
    try:
        for size in (1000, 6 * MiB):  # copied on the loop, then in a thread
            data = make_bytes(size, seed=size)
            await conn.put("k", [memoryview(data)[:7], memoryview(data)[7:]])
            dest = bytearray(size)

            def alloc(n: int, dest: bytearray = dest) -> memoryview | None:
                return memoryview(dest) if n == len(dest) else None

            got = await conn.get_into("k", alloc)
            assert got is not None
            assert got.obj is dest
            assert_same_bytes(dest, data, f"{size} bytes")
    finally:
        await conn.close()


async def test_an_object_over_the_readers_limit_is_refused_unallocated(
    s3_server: S3Server, prefix: str
) -> None:
    conn = obstore_connector(s3_server, prefix)
    asked: list[int] = []

    def alloc(n: int) -> None:
        asked.append(n)

    try:
        await conn.put("big", bytes(4 * MiB))
        with limiting_reads(MiB), pytest.raises(CorruptObject, match="over"):
            await conn.get_into("big", alloc)
        assert asked == []
        got = await conn.get_into("big", alloc)
        assert got is not None
        assert got.nbytes == 4 * MiB
        assert asked == [4 * MiB]
    finally:
        await conn.close()


async def test_multipart_upload_when_asked_for(s3_server: S3Server, prefix: str) -> None:
    conn = obstore_connector(
        s3_server, prefix, multipart_threshold=5 * MiB, part_size=5 * MiB, max_concurrency=2
    )
    data = make_bytes(12 * MiB + 5, seed=7)
    view = memoryview(data)
    try:
        await conn.put("mp", [view[:100], view[100 : 9 * MiB], view[9 * MiB :]])
        assert_same_bytes(await conn.get("mp"), data, "multipart object")
        async with raw_s3(s3_server) as s3:
            head = await s3.head_object(Bucket=s3_server.bucket, Key=f"{prefix}/mp.")
        assert str(head["ETag"]).endswith('-3"')  # three parts: it was a multipart upload
    finally:
        await conn.close()


# -- a slow or absent server -------------------------------------------------------------------


async def test_a_stalled_server_times_out(s3_server: S3Server, prefix: str) -> None:
    async with tcp_proxy(s3_server.port) as proxy:
        conn = obstore_connector(
            s3_server, prefix, endpoint_url=proxy.endpoint, request_timeout=0.5
        )
        try:
            await conn.put("k", b"v")
            proxy.stall()
            for call in (lambda: conn.get("k"), lambda: conn.put("k", b"w")):
                start = time.monotonic()
                with pytest.raises(Timeout):
                    await call()
                assert time.monotonic() - start < 6.0  # 0.5 s against a stall with no end
            proxy.resume()
            proxy.cut()
            assert bytes(await conn.get("k") or b"") in (b"v", b"w")
        finally:
            await conn.close()


# Keys that spell S3's error codes: the request's URL (in obstore's message) holds them.
CODE_KEYS = ("NoSuchBucket", "AccessDenied", "EntityTooLarge", "SignatureDoesNotMatch")


async def test_a_server_that_is_down_is_unavailable(s3_server: S3Server, prefix: str) -> None:
    conn = obstore_connector(
        s3_server, prefix, endpoint_url=f"http://127.0.0.1:{free_port()}", connect_timeout=1
    )
    try:
        for key in ("k", *CODE_KEYS):
            for call in (lambda k=key: conn.get(k), lambda k=key: conn.put(k, b"v")):
                start = time.monotonic()
                with pytest.raises(Unavailable) as err:
                    await call()
                assert type(err.value) is Unavailable  # not a ConfigError or CapacityError
                assert time.monotonic() - start < 5.0
    finally:
        await conn.close()


async def test_keys_that_spell_error_codes_are_plain_keys(s3_server: S3Server, prefix: str) -> None:
    conn = obstore_connector(s3_server, prefix)
    try:
        for key in CODE_KEYS:
            assert await conn.get(key) is None
            assert not await conn.exists(key)
            assert await conn.delete(key) is False
            await conn.put(key, key.encode())
            assert bytes(await conn.get(key) or b"") == key.encode()
        assert await listed(conn, "") == {k: len(k) for k in CODE_KEYS}
    finally:
        await conn.close()


def test_options_obstore_refuses_are_config_errors(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-ca.pem"
    not_pem = tmp_path / "not.pem"
    not_pem.write_bytes(b"this is not a certificate")
    for options in ({"ca_bundle": str(missing)}, {"ca_bundle": str(not_pem)}):
        with pytest.raises(ConfigError):
            ObstoreS3Connector.from_url("obstore+s3://bucket/p", **options)
    tiny = ObstoreS3Connector.from_url("obstore+s3://bucket/p", request_timeout=1e-3)
    assert tiny.options.request_timeout == 1e-3  # obstore took "1ms"


async def test_through_a_store(s3_server: S3Server, prefix: str) -> None:
    """Framed objects (tensors' metadata, checksums) round-trip through a Store's tier."""
    url = f"obstore+s3://{s3_server.bucket}/{prefix}"
    config: dict[str, Any] = {"tiers": [{"url": url, "options": s3_server.options()}]}
    async with Store(config) as store:
        data = make_bytes(3 * MiB + 1, seed=3)
        await store.put("chunk", data, durable=True)
        assert_same_bytes(await store.get("chunk"), data, "through the Store")
        assert await store.contains("chunk")
        assert await store.lookup(["chunk", "absent", "chunk"]) == 1
        assert await store.delete("chunk")
        assert await store.get("chunk") is None


async def test_raw_client_baseline_measures_and_cleans_up(s3_server: S3Server) -> None:
    url = f"obstore+s3://{s3_server.bucket}/baseline-ob"
    put_gbps, get_gbps = await ObstoreS3Connector.raw_client_baseline(
        url,
        s3_server.options(),
        size=256 * 1024,
        count=4,
        concurrency=2,
        payloads=[bytes([i]) * 256 * 1024 for i in range(3)],
    )
    assert put_gbps > 0
    assert get_gbps > 0
    async with raw_s3(s3_server) as s3:
        left = await s3.list_objects_v2(Bucket=s3_server.bucket, Prefix="baseline-ob/")
    assert left.get("KeyCount", 0) == 0
