"""opendal+<service>:// beyond the conformance suite: key paths, options, the registry's
family rule, and faults on real servers (a WebDAV server killed mid-put or stalled, garbage
written behind the connector's back on FTP)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import time
from pathlib import Path

import pytest
from servers.azurite import AzuriteServer
from servers.ftp import FtpServer
from servers.webdav import WebdavServer

from connectors.opendal import OpendalConnector, paths, seal
from gateway.cli.app import app
from gateway.errors import (
    CapacityError,
    ConfigError,
    CorruptObject,
    NotFound,
    Timeout,
    Unavailable,
)
from gateway.registry import connect, connector_class
from gateway.testing import ODD_KEYS, assert_same_bytes, make_bytes

KiB, MiB = 1 << 10, 1 << 20


@pytest.mark.parametrize("key", [*ODD_KEYS, "x" * 199, "y" * 200, "z" * 201, "é" * 150])
def test_every_key_has_its_own_safe_path(key: str) -> None:
    path = paths.path_of(key)
    assert paths.key_of(path) == key
    segments = path.split("/")
    assert all(0 < len(s) <= paths.SEGMENT + 1 for s in segments)
    assert all(s.endswith("+") for s in segments[:-1])
    assert not any(s in (".", "..") or s.startswith(".") for s in segments)


def test_paths_never_collide_and_foreign_names_are_not_keys() -> None:
    keys = [*ODD_KEYS, "a" * 200, "a" * 200 + "b", "a" * 400]
    assert len({paths.path_of(k) for k in keys}) == len(keys)
    for foreign in ("plain.txt", ".kvgate-staging/abc", "a%2f", "a%ZZ", "x/y", "x+/y"):
        assert paths.key_of(foreign) is None


def test_a_prefixs_keys_live_under_its_list_root() -> None:
    cases = [("", "k"), ("ab", "abc"), ("p" * 200, "p" * 200), ("p" * 200, "p" * 250)]
    cases += [("q" * 450, "q" * 500), ("r" * 400, "r" * 400), ("r" * 399, "r" * 401)]
    for prefix, key in cases:
        assert paths.path_of(key).startswith(paths.list_root(prefix))


async def test_a_key_and_its_longer_extension_at_a_segment_boundary(tmp_path: Path) -> None:
    """A 200-character key is a file where a longer key that starts with it needs a folder."""
    conn = OpendalConnector.from_url(f"opendal+fs://{tmp_path}")
    keys = ["s" * 200, "s" * 200 + "t", "s" * 400, "s" * 400 + "u"]
    try:
        for key in keys:
            await conn.put(key, key.encode())
        for key in keys:
            assert await conn.get(key) == key.encode()
        assert sorted([i.key async for i in conn.list("s" * 200)]) == sorted(keys)
        assert sorted([i.key async for i in conn.list("s" * 400)]) == keys[2:]
    finally:
        await conn.close()


def test_urls_and_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="no service 'nosuch'"):
        OpendalConnector.from_url("opendal+nosuch://")
    with pytest.raises(ConfigError, match="no host"):
        OpendalConnector.from_url("opendal+webdav://127.0.0.1:8080/x")
    with pytest.raises(ConfigError, match="'endpont' is neither"):
        OpendalConnector.from_url("opendal+webdav:///x", endpont="http://h")
    with pytest.raises(ConfigError, match="atomic"):
        OpendalConnector.from_url("opendal+memory://", atomic="sometimes")
    with pytest.raises(ConfigError, match="cannot rename"):
        OpendalConnector.from_url("opendal+memory://", atomic="rename")
    with pytest.raises(ConfigError, match="root is given twice"):
        OpendalConnector.from_url("opendal+fs:///a", root="/b")


def test_repr_hides_secrets() -> None:
    conn = OpendalConnector.from_url(
        "opendal+ftp:///x", endpoint="ftp://127.0.0.1:1", user="u", password="hunter2-secret"
    )
    assert "hunter2" not in repr(conn)
    assert "ftp://127.0.0.1:1" in repr(conn)


async def test_the_registry_resolves_every_service_through_one_entry() -> None:
    for url in ("opendal+memory://", "OPENDAL+Memory://"):
        conn = connect(url)
        try:
            assert isinstance(conn, OpendalConnector)
            assert conn.scheme == "opendal+memory"
            assert conn.atomic == "native"  # an in-process map's insert is whole
            assert conn.capabilities.persistent is False
        finally:
            await conn.close()
    for url, options, atomic in [
        ("opendal+azblob:///r", {"container": "c", "endpoint": "http://127.0.0.1:1"}, "native"),
        ("opendal+gcs:///r", {"bucket": "b", "endpoint": "http://127.0.0.1:1"}, "native"),
        ("opendal+s3:///r", {"bucket": "b", "region": "us-east-1"}, "native"),
        ("opendal+fs:///tmp", {}, "rename"),
        ("opendal+ftp:///r", {"endpoint": "ftp://127.0.0.1:1"}, "sealed"),
    ]:
        conn = connect(url, **options)
        assert conn.atomic == atomic, url  # an object store's PUT is whole: no trailer
        await conn.close()
    conn = connect("opendal+fs:///tmp", atomic="native")
    assert conn.capabilities.persistent is True
    assert conn.capabilities.list is True
    await conn.close()


def test_kvgate_connectors_lists_the_family_and_unknown_families_are_not_found() -> None:
    from typer.testing import CliRunner

    result = CliRunner().invoke(app, ["connectors", "--json"])
    assert result.exit_code == 0, result.output
    found = {c["name"]: c for c in json.loads(result.stdout)["connectors"]}
    assert found["opendal+"]["usable"] is True
    with pytest.raises(NotFound, match="nosuch"):
        connector_class("nosuch+webdav")


async def test_objects_over_the_maximum_are_refused(tmp_path: Path) -> None:
    conn = OpendalConnector.from_url(f"opendal+fs://{tmp_path}", max_object_size=MiB)
    try:
        with pytest.raises(CapacityError):
            await conn.put("k", [make_bytes(MiB), b"!"])
        assert not await conn.exists("k")
    finally:
        await conn.close()


async def test_staging_leftovers_of_dead_puts_are_swept(tmp_path: Path) -> None:
    staging = tmp_path / paths.STAGING
    staging.mkdir()
    (staging / "dead").write_bytes(b"x" * 100)
    (staging / "live").write_bytes(b"y")
    two_hours_ago = time.time() - 7200
    os.utime(staging / "dead", (two_hours_ago, two_hours_ago))
    conn = OpendalConnector.from_url(f"opendal+fs://{tmp_path}")
    try:
        await conn.put("k", b"v")  # the first put starts the sweep beside it
        deadline = time.monotonic() + 10
        while (staging / "dead").exists():
            assert time.monotonic() < deadline, "the dead put's staging object is still there"
            await asyncio.sleep(0.05)
        assert await conn.get("k") == b"v"
    finally:
        await conn.close()
    assert sorted(p.name for p in staging.iterdir()) == ["live"]


async def test_rename_mode_on_webdav_round_trips(webdav_server: WebdavServer) -> None:
    conn = OpendalConnector.from_url(webdav_server.url, **webdav_server.options())
    try:
        assert conn.atomic == "rename"
        for key in ("rename/a", "rename/" + "long" * 100):
            for seed in (1, 2):
                data = make_bytes(300 * KiB, seed)
                await conn.put(key, data)
                assert_same_bytes(await conn.get(key), data)
            assert await conn.delete(key)
        listed = [i.key async for i in conn.list("")]
        assert not any(k.startswith("rename/") for k in listed)
    finally:
        await conn.close()


async def test_a_webdav_server_killed_mid_put_keeps_the_old_object(
    webdav_private: WebdavServer,
) -> None:
    """Rename mode: the new object goes to a staging path; killed mid-upload, the key still
    holds the old object whole once the server is back."""
    conn = OpendalConnector.from_url(webdav_private.url, **webdav_private.options(timeout=5.0))
    old = make_bytes(MiB, 1)
    try:
        await conn.put("victim", old)
        put = asyncio.create_task(conn.put("victim", make_bytes(192 * MiB, 2)))
        await asyncio.sleep(0.1)
        assert not put.done(), "the put finished before the kill: nothing was tested"
        webdav_private.process.kill()
        with pytest.raises((Unavailable, Timeout)):
            await put
        with pytest.raises((Unavailable, Timeout)):
            await conn.get("victim")
        webdav_private.process.start()
        assert_same_bytes(await conn.get("victim"), old, "the old object after the restart")
    finally:
        await conn.close()


async def test_a_stalled_webdav_server_times_out_then_serves_again(
    webdav_private: WebdavServer,
) -> None:
    conn = OpendalConnector.from_url(webdav_private.url, **webdav_private.options(timeout=1.0))
    try:
        await conn.put("k", b"value")
        with webdav_private.process.paused():
            for call in (conn.get("k"), conn.put("k", b"other"), conn.exists("k")):
                start = time.monotonic()
                with pytest.raises(Timeout):
                    await call
                assert time.monotonic() - start < 8.0  # 1 s against a pause with no end
        got = await conn.get("k")
        assert got is not None
        assert bytes(got) in (b"value", b"other")
    finally:
        await conn.close()


async def test_garbage_behind_the_connector_is_corrupt_never_data(ftp_server: FtpServer) -> None:
    """Sealed mode (FTP cannot rename): bytes written into the server's folder by someone
    else, or a sealed object cut short, fail the trailer check on every read."""
    conn = OpendalConnector.from_url(ftp_server.url, **ftp_server.options())
    try:
        assert conn.atomic == "sealed"
        await conn.put("garbage/a", make_bytes(64 * KiB, 1))
        await conn.put("garbage/b", make_bytes(64 * KiB, 2))
        file_a = ftp_server.folder / "kvgate" / paths.path_of("garbage/a")
        file_b = ftp_server.folder / "kvgate" / paths.path_of("garbage/b")
        file_a.write_bytes(b"not what the connector wrote")
        file_b.write_bytes(file_b.read_bytes()[: 32 * KiB])  # a torn object, left so
        for key in ("garbage/a", "garbage/b"):
            with pytest.raises(CorruptObject):
                await conn.get(key)
        await conn.put("garbage/a", b"fresh")
        assert await conn.get("garbage/a") == b"fresh"
        assert file_a.stat().st_size == 5 + seal.SIZE
    finally:
        await conn.close()


async def test_raw_client_baseline_measures_and_cleans_up(webdav_server: WebdavServer) -> None:
    put_gbs, get_gbs = await OpendalConnector.raw_client_baseline(
        webdav_server.url,
        webdav_server.options(),
        size=MiB,
        count=4,
        concurrency=2,
        payloads=[bytes([i]) * MiB for i in range(3)],
    )
    assert put_gbs > 0
    assert get_gbs > 0
    names = [p.name for p in (webdav_server.folder / "kvgate").iterdir()]
    assert not any(n.startswith("kvgate-baseline-") for n in names)


async def test_a_wrong_azure_key_is_refused_and_never_shown(azurite_server: AzuriteServer) -> None:
    wrong = base64.b64encode(b"not-the-account-key" * 3).decode()
    conn = OpendalConnector.from_url(
        f"opendal+azblob:///wrong-key-{os.getpid()}",
        **azurite_server.opendal_options(account_key=wrong, atomic="native"),
    )
    try:
        with pytest.raises(ConfigError) as refused:
            await conn.put("k", b"v")
        assert "PermissionDenied" in str(refused.value)
        for shown in (str(refused.value), repr(conn)):
            assert wrong not in shown
            assert azurite_server.key not in shown
    finally:
        await conn.close()


async def test_a_listing_stalled_between_pages_times_out(webdav_private: WebdavServer) -> None:
    conn = OpendalConnector.from_url(webdav_private.url, **webdav_private.options(timeout=1.0))
    try:
        # Long keys live in segment folders, each listed by a request of its own as the
        # listing reaches it: requests made after the first key came back.
        keys = ["a", *(f"{c}" * 250 for c in "bcd")]
        for key in keys:
            await conn.put(key, b"v")
        listing = conn.list()
        await anext(listing)

        async def the_rest() -> None:
            async with asyncio.timeout(10):  # a hang fails here (TimeoutError, not Timeout)
                async for _ in listing:
                    pass

        start = time.monotonic()
        with webdav_private.process.paused(), pytest.raises(Timeout):
            await the_rest()
        assert time.monotonic() - start < 8.0
        await listing.aclose()
    finally:
        await conn.close()
