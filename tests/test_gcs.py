"""gs:// beyond the conformance suite, against gcp-storage-emulator.

URLs and options, the emulator from the environment, a missing bucket, composed puts and ranged
gets with small sizes (their temporary parts cleaned up, a long key's metadata set by the
compose), writers racing on composed objects, faults (a server killed mid-put, a stalled server
against the timeout) and the raw-client baseline. What the emulator cannot show (credentials,
the ranges' generation pin) is listed in tests/servers/gcs_emulator.py.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
from servers.gcs_emulator import GcsServer

from connectors.gcs import GcsConnector
from gateway.errors import ConfigError, Timeout, Unavailable
from gateway.registry import connect
from gateway.testing import assert_same_bytes, digest, listed, make_bytes

MiB = 1 << 20
SMALL = {
    "put_threshold": 256 * 1024,
    "part_size": 256 * 1024,
    "ranged_get_threshold": 256 * 1024,
    "range_size": 256 * 1024,
    "max_concurrency": 4,
}


@pytest.fixture
def prefix() -> str:
    return f"test-{uuid.uuid4().hex[:10]}"


def gcs(server: GcsServer, prefix: str, **options: Any) -> GcsConnector:
    return GcsConnector.from_url(server.url(prefix), **server.options(**options))


def object_names(server: GcsServer, prefix: str) -> list[str]:
    """Every object name under ``prefix``, read around the connector."""
    query = urllib.parse.urlencode({"prefix": prefix})
    url = f"{server.endpoint}/storage/v1/b/{server.bucket}/o?{query}"
    with urllib.request.urlopen(url, timeout=5) as resp:
        return [item["name"] for item in json.load(resp).get("items", [])]


# -- options and URLs ------------------------------------------------------------------------------


def test_url_and_options_are_checked() -> None:
    conn = connect("gs://bucket/a/b", endpoint="http://127.0.0.1:9")
    assert isinstance(conn, GcsConnector)
    assert (conn.bucket, conn.location.prefix) == ("bucket", "a/b/")
    assert GcsConnector.from_url("gs://bucket").location.prefix == ""
    bad: list[tuple[str, dict[str, Any]]] = [
        ("gs://bucket/p", {"no_such_option": 1}),
        ("gs://bucket/p", {"endpoint": "ftp://host"}),
        ("gs://bucket/p", {"part_size": 0}),
        ("gs://user:pw@bucket/p", {}),
        ("gs://b/p", {}),  # bucket name too short
        ("gs://Bucket/p", {}),
        ("gs://bucket/a/../b", {}),
        ("gs://bucket/p?x=1", {}),
        ("s3://bucket/p", {}),
    ]
    for url, options in bad:
        with pytest.raises(ConfigError):
            GcsConnector.from_url(url, **options)


async def test_the_emulator_can_come_from_the_environment(
    gcs_server: GcsServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"127.0.0.1:{gcs_server.port}")
    conn = GcsConnector.from_url(gcs_server.url(prefix))
    try:
        await conn.put("k", b"via STORAGE_EMULATOR_HOST")
        assert await conn.get("k") == b"via STORAGE_EMULATOR_HOST"
    finally:
        await conn.close()


async def test_a_missing_bucket_is_named(gcs_server: GcsServer) -> None:
    bucket = f"kvgate-missing-{uuid.uuid4().hex[:8]}"
    conn = GcsConnector.from_url(f"gs://{bucket}/p", endpoint=gcs_server.endpoint)
    try:
        for call in (lambda: conn.get("k"), lambda: conn.put("k", b"v"), conn.ping):
            with pytest.raises(ConfigError, match=bucket):
                await call()
    finally:
        await conn.close()


async def test_an_unreadable_credentials_file_is_a_config_error_naming_it(
    gcs_server: GcsServer, prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "no-such-service-account.json"
    conn = GcsConnector.from_url(
        gcs_server.url(prefix), endpoint=gcs_server.endpoint, service_file=str(missing)
    )
    try:
        with pytest.raises(ConfigError, match="no-such-service-account"):
            await conn.put("k", b"v")
    finally:
        await conn.close()
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(missing))
    conn = GcsConnector.from_url(gcs_server.url(prefix), endpoint=gcs_server.endpoint)
    try:
        with pytest.raises(ConfigError, match="no-such-service-account"):
            await conn.get("k")
    finally:
        await conn.close()


# -- composed puts and ranged gets -------------------------------------------------------------


@pytest.mark.parametrize("long_key", [False, True], ids=["plain-key", "hashed-key"])
@pytest.mark.both_loops  # aiohttp under `kvgate serve`, which runs uvloop
async def test_composed_put_and_ranged_get_of_a_scatter_list(
    gcs_server: GcsServer, prefix: str, long_key: bool
) -> None:
    conn = gcs(gcs_server, prefix, **SMALL)
    key = "big/" + "k" * 1200 if long_key else "big"
    pieces = [b"head", make_bytes(MiB, seed=1), bytearray(make_bytes(300_001, seed=2))]
    want = b"".join(pieces)
    slabs: list[bytearray] = []

    def alloc(n: int) -> memoryview:
        slabs.append(bytearray(n))
        return memoryview(slabs[-1])

    try:
        await conn.put(key, pieces)
        got = await conn.get_into(key, alloc)
        assert_same_bytes(got, want, "composed object")
        assert [len(s) for s in slabs] == [len(want)]  # filled in place: the caller's buffer
        assert await listed(conn, "") == {key: len(want)}  # the hashed key from the compose
    finally:
        await conn.close()  # waits for the parts' deletion
    assert len(object_names(gcs_server, f"{prefix}/")) == 1, "temporary parts were left"


async def test_writers_racing_on_a_composed_object_never_tear_it(
    gcs_server: GcsServer, prefix: str
) -> None:
    conn = gcs(gcs_server, prefix, **SMALL)
    values = [make_bytes(MiB, seed=50 + i) for i in range(6)]
    try:
        await asyncio.gather(*(conn.put("contended", v) for v in values))
        got = await conn.get("contended")
        assert got is not None
        assert digest(got) in {digest(v) for v in values}, "the object mixes several writes"
    finally:
        await conn.close()


@pytest.mark.both_loops  # aiohttp under `kvgate serve`, which runs uvloop
async def test_a_cancelled_composed_put_leaves_no_object_and_no_parts(
    gcs_server: GcsServer, prefix: str
) -> None:
    conn = gcs(gcs_server, prefix, **{**SMALL, "max_concurrency": 1})
    put = asyncio.create_task(conn.put("big", make_bytes(8 * MiB, seed=5)))
    deadline = time.monotonic() + 10
    # In a thread: the emulator serves one request at a time, so a blocking call from this
    # loop while it waits for the connector's upload body (sent by this loop) would deadlock.
    while not await asyncio.to_thread(object_names, gcs_server, f"{prefix}/"):
        assert time.monotonic() < deadline, "no part was ever uploaded"
        await asyncio.sleep(0.01)
    put.cancel()
    with pytest.raises(asyncio.CancelledError):
        await put
    await conn.close()  # waits for the parts' deletion, which runs in the background
    assert await asyncio.to_thread(object_names, gcs_server, f"{prefix}/") == []


# -- faults --------------------------------------------------------------------------------------


async def test_a_server_killed_mid_put_fails_the_put_and_the_connector_recovers(
    gcs_server_private: GcsServer, prefix: str
) -> None:
    server = gcs_server_private
    conn = gcs(server, prefix, request_timeout=2.0, **SMALL)
    try:
        await conn.put("k", b"before")
        put = asyncio.create_task(conn.put("big", make_bytes(32 * MiB, seed=3)))
        await asyncio.sleep(0.3)  # parts are being uploaded
        assert not put.done()
        server.kill()
        start = time.monotonic()
        with pytest.raises(Unavailable):
            await put
        assert time.monotonic() - start < 5.0
        with pytest.raises(Unavailable):
            await conn.get("k")
        server.start()  # same port, empty (in memory)
        assert await conn.get("big") is None  # never a partial object
        await conn.put("big", make_bytes(MiB, seed=4))
        assert_same_bytes(await conn.get("big"), make_bytes(MiB, seed=4), "after the restart")
    finally:
        await conn.close()


async def test_a_stalled_server_times_out(gcs_server_private: GcsServer, prefix: str) -> None:
    server = gcs_server_private
    conn = gcs(server, prefix, request_timeout=0.5)
    try:
        await conn.put("k", b"v")
        with server.process.paused():
            for call in (lambda: conn.get("k"), lambda: conn.put("k", b"w"), conn.ping):
                start = time.monotonic()
                with pytest.raises(Timeout):
                    await call()
                assert time.monotonic() - start < 6.0  # 0.5 s against a pause with no end
        assert await conn.get("k") in (b"v", b"w")  # the server answers again
    finally:
        await conn.close()


async def test_raw_client_baseline_measures_and_cleans_up(gcs_server: GcsServer) -> None:
    put_gbps, get_gbps = await GcsConnector.raw_client_baseline(
        gcs_server.url("baseline"),
        gcs_server.options(),
        size=256 * 1024,
        count=4,
        concurrency=2,
        payloads=[bytes([i]) * 256 * 1024 for i in range(3)],
    )
    assert put_gbps > 0
    assert get_gbps > 0
    assert object_names(gcs_server, "baseline/") == []
