"""s3:// aborts the multipart uploads that dead puts left behind, against a real SeaweedFS.

Uploads are made with a plain client, under the connector's prefix (with names that the
connector writes, and one it does not), under a sibling prefix and elsewhere in the bucket;
only the connector's own stale ones may go.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from servers.s3 import S3Server, raw_s3, tcp_proxy

from connectors.object_names import Naming
from connectors.s3 import S3Connector, sweep
from gateway.errors import ConfigError, Timeout
from gateway.testing import assert_same_bytes, make_bytes

MiB = 1 << 20
SMALL_PARTS = {"multipart_threshold": 5 * MiB, "part_size": 5 * MiB}


@pytest.fixture
def prefix() -> str:
    return f"sweep-{uuid.uuid4().hex[:10]}"


async def start_upload(server: S3Server, name: str) -> str:
    """A multipart upload of ``name`` with one part sent and never completed."""
    async with raw_s3(server) as s3:
        created = await s3.create_multipart_upload(Bucket=server.bucket, Key=name)
        upload_id: str = created["UploadId"]
        # A connector sweeping every 0.2 s may abort the upload before its part arrives: the
        # tests look at the upload, the part only makes it what a dead put leaves.
        with contextlib.suppress(s3.exceptions.NoSuchUpload):
            await s3.upload_part(
                Bucket=server.bucket, Key=name, UploadId=upload_id, PartNumber=1, Body=b"part"
            )
    return upload_id


async def uploads(server: S3Server) -> set[tuple[str, str]]:
    """Every open upload of the bucket: (name, upload id)."""
    async with raw_s3(server) as s3:
        page = await s3.list_multipart_uploads(Bucket=server.bucket)
    assert not page.get("IsTruncated")
    return {(u["Key"], u["UploadId"]) for u in page.get("Uploads", [])}


async def wait_until(check: Callable[[], Any], what: str, within: float = 15.0) -> None:
    deadline = time.monotonic() + within
    while not await check():
        assert time.monotonic() < deadline, f"{what} did not happen in {within}s"
        await asyncio.sleep(0.05)


def connector(server: S3Server, prefix: str, **options: Any) -> S3Connector:
    return S3Connector.from_url(server.url(prefix), **server.options(**options))


def name_of(prefix: str, key: str) -> str:
    return Naming(f"{prefix}/").object_name(key)


def test_sweep_options_are_checked() -> None:
    opts = S3Connector.from_url("s3://bucket/p").options
    assert opts.abort_uploads_older_than == 3600.0  # a live gateway's uploads are younger
    assert opts.abort_uploads_every == 3600.0
    off = S3Connector.from_url(
        "s3://bucket/p", abort_uploads_older_than=None, abort_uploads_every=None
    ).options
    assert (off.abort_uploads_older_than, off.abort_uploads_every) == (None, None)
    for bad in (
        {"abort_uploads_older_than": -1},
        {"abort_uploads_older_than": float("nan")},
        {"abort_uploads_older_than": "soon"},
        {"abort_uploads_every": 0},
        {"abort_uploads_every": float("inf")},
        {"abort_uploads_every": -5},
    ):
        with pytest.raises(ConfigError, match="abort_uploads"):
            S3Connector.from_url("s3://bucket/p", **bad)


async def test_a_sweep_asked_for_checks_its_age() -> None:
    conn = S3Connector.from_url("s3://bucket/p", endpoint_url="http://127.0.0.1:9")
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="older_than"):
            await conn.abort_stale_uploads(older_than=bad)
    await conn.close()


async def test_stale_uploads_under_the_prefix_are_aborted_at_open(
    s3_server: S3Server, prefix: str
) -> None:
    mine = [
        await start_upload(s3_server, name_of(prefix, k))
        for k in ("k1", "a/long/" * 40, "h" * 1200)
    ]
    keep = {
        (name, await start_upload(s3_server, name))
        for name in (
            name_of(f"{prefix}x", "k1"),  # a sibling prefix that shares the first characters
            name_of(f"other-{prefix}", "k1"),
            f"{prefix}/foreign.bin",  # under the prefix, but not a name the connector writes
            f"{prefix}/sub/x",
        )
    }
    conn = connector(s3_server, prefix, abort_uploads_older_than=0)
    try:
        assert not await conn.exists("anything")  # the first use starts the client, and the sweep

        async def mine_gone() -> bool:
            return not {u for _, u in await uploads(s3_server)} & set(mine)

        await wait_until(mine_gone, "the sweep at open")
        assert keep <= await uploads(s3_server)
    finally:
        await conn.close()


async def test_young_uploads_are_kept_by_default(s3_server: S3Server, prefix: str) -> None:
    """The default age is an hour: an upload in progress elsewhere (another gateway on the
    prefix) is never aborted by a sweep."""
    name = name_of(prefix, "in-progress")
    upload_id = await start_upload(s3_server, name)
    conn = connector(s3_server, prefix)
    try:
        assert await conn.abort_stale_uploads() == 0
        assert (name, upload_id) in await uploads(s3_server)
    finally:
        await conn.close()
    async with raw_s3(s3_server) as s3:
        await s3.abort_multipart_upload(Bucket=s3_server.bucket, Key=name, UploadId=upload_id)


async def test_a_sweep_walks_every_page(
    s3_server: S3Server, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More stale uploads than a page holds: SeaweedFS pages by upload id alone (it sends no
    NextKeyMarker), and a sweep still reaches them all, within its page bound."""
    monkeypatch.setattr(sweep, "PAGE_SIZE", 2)
    ids = {await start_upload(s3_server, name_of(prefix, f"k{i}")) for i in range(5)}
    conn = connector(s3_server, prefix, abort_uploads_older_than=None)  # no sweeps of its own
    try:
        monkeypatch.setattr(sweep, "MAX_PAGES", 1)
        assert await conn.abort_stale_uploads(older_than=0) == 2  # the rest waits
        monkeypatch.setattr(sweep, "MAX_PAGES", 10)
        assert await conn.abort_stale_uploads(older_than=0) == 3
        assert not ids & {u for _, u in await uploads(s3_server)}
    finally:
        await conn.close()


async def test_scheduled_sweeps_stop_at_close(s3_server: S3Server, prefix: str) -> None:
    first = await start_upload(s3_server, name_of(prefix, "before-open"))
    conn = connector(s3_server, prefix, abort_uploads_older_than=0, abort_uploads_every=0.2)

    async def gone(upload_id: str) -> Callable[[], Any]:
        async def check() -> bool:
            return upload_id not in {u for _, u in await uploads(s3_server)}

        return check

    try:
        await conn.put("k", b"v")
        await wait_until(await gone(first), "the sweep at open")
        # Made after the first sweep aborted what it had listed: only a later sweep sees it.
        later = await start_upload(s3_server, name_of(prefix, "after-open"))
        await wait_until(await gone(later), "a scheduled sweep")
    finally:
        async with asyncio.timeout(10):  # close cancels the sweeps: it does not wait for them
            await conn.close()
    after_close = await start_upload(s3_server, name_of(prefix, "after-close"))
    await asyncio.sleep(1.0)  # five periods: a sweep still running would have aborted it
    assert after_close in {u for _, u in await uploads(s3_server)}
    async with raw_s3(s3_server) as s3:
        await s3.abort_multipart_upload(
            Bucket=s3_server.bucket, Key=name_of(prefix, "after-close"), UploadId=after_close
        )


async def test_own_uploads_in_flight_are_never_aborted(s3_server: S3Server, prefix: str) -> None:
    """Even with an age of 0, the connector's own puts in progress are not swept."""
    conn = connector(
        s3_server, prefix, max_concurrency=1, abort_uploads_older_than=None, **SMALL_PARTS
    )
    data = make_bytes(12 * MiB, seed=3)
    # The test holds the one slot that parts are sent in: the upload is created, then waits.
    slots = conn._client.slots
    await slots.acquire()
    try:
        put = asyncio.create_task(conn.put("big", data))
        await wait_until(lambda: _any_upload_under(s3_server, prefix), "the upload to start")
        assert await conn.abort_stale_uploads(older_than=0) == 0
        assert await _any_upload_under(s3_server, prefix)
        slots.release()
        await put
        assert_same_bytes(await conn.get("big"), data, "big")
    finally:
        if slots.locked():
            slots.release()
        await conn.close()


async def _any_upload_under(server: S3Server, prefix: str) -> bool:
    return any(name.startswith(f"{prefix}/") for name, _ in await uploads(server))


async def test_a_failed_sweep_is_logged_not_fatal(
    s3_server: S3Server, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    stale = await start_upload(s3_server, name_of(prefix, "stale"))
    async with tcp_proxy(s3_server.port) as proxy:
        conn = S3Connector.from_url(
            s3_server.url(prefix),
            **s3_server.options(
                endpoint_url=proxy.endpoint,
                check_bucket=False,
                request_timeout=0.3,
                abort_uploads_older_than=0,
                abort_uploads_every=0.2,
            ),
        )
        try:
            with caplog.at_level(logging.WARNING, logger="connectors.s3"):
                proxy.stall()
                with pytest.raises(Timeout):
                    await conn.exists("k")  # builds the client: the sweep starts and stalls

                async def logged() -> bool:
                    return "could not abort stale multipart uploads" in caplog.text

                await wait_until(logged, "the failed sweep's warning")
                proxy.resume()
                proxy.cut()
                await conn.put("k", b"v")  # the tier works on
                assert await conn.get("k") == b"v"

                async def swept() -> bool:
                    return stale not in {u for _, u in await uploads(s3_server)}

                await wait_until(swept, "the next sweep")  # and so do the sweeps
        finally:
            await conn.close()
