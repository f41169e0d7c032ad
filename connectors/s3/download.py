"""Reading one object into one buffer: one GET when small, parallel ranges when large.

The first request is a plain ``GET``: its headers give the object's size and ETag before any
body byte is read, so the buffer is allocated at once. An object up to
``ranged_get_threshold`` is that one response, streamed into the buffer (a plain GET, not a
ranged one: S3 servers such as SeaweedFS answer it faster). For a larger object the first
response supplies only the first ``range_size`` bytes and is then dropped, while the remaining
ranges (``range_size`` each) run in parallel. Ranges and multipart parts share the connector's
``max_concurrency`` slots, so many large reads at once queue for them instead of flooding the
server with streams. Each body is streamed straight into its slice of the buffer.

No read mixes two versions of an object: every range carries ``If-Match: <ETag of the first
response>``. An overwrite in between makes S3 answer 412; the whole read starts again
(``CHANGE_RETRIES`` times at most, then ``Unavailable``). A smaller object is one response,
which S3 serves from one version. A key deleted in between reads as a miss.

Each request (headers and body) is bounded by ``request_timeout``; each moves at most
``max(ranged_get_threshold, range_size)`` bytes, so the bound fits any object size.
"""

from __future__ import annotations

import asyncio
from typing import Any

from botocore.exceptions import ClientError  # type: ignore[import-untyped]

from connectors.object_names import shown
from connectors.read_target import ReadTarget
from connectors.s3.client import S3Client
from connectors.s3.errors import is_changed, is_missing, s3_errors
from connectors.s3.transfer import limited, read_body_into, run_all, spans
from gateway.connector import Allocator, read_limit
from gateway.errors import OverReadLimit, Unavailable

CHANGE_RETRIES = 3


class ObjectChanged(Unavailable):
    """The object was overwritten or deleted between two ranges of one read."""


async def download(client: S3Client, name: str, alloc: Allocator) -> memoryview | None:
    """The object ``name`` in a buffer from ``alloc`` (or a new one); None on a miss."""
    target = ReadTarget(alloc)
    for attempt in range(CHANGE_RETRIES):
        try:
            return await _read_once(client, name, target)
        except ObjectChanged:
            if attempt == CHANGE_RETRIES - 1:
                raise
    raise AssertionError("unreachable")


async def _read_once(client: S3Client, name: str, target: ReadTarget) -> memoryview | None:
    opts = client.options
    where = f"{client.where} GET {shown(name)}"
    with s3_errors(where, client.bucket):
        s3 = await client.get()
        deadline = asyncio.get_running_loop().time() + opts.request_timeout
        try:
            async with asyncio.timeout_at(deadline):
                resp = await s3.get_object(Bucket=client.bucket, Key=name)
        except ClientError as exc:
            if is_missing(exc):
                return None
            raise
        body = resp["Body"]
        size = int(resp["ContentLength"])
        limit = read_limit()
        if limit is not None and size > limit:  # stored there by anyone: never an allocation
            body.close()
            raise OverReadLimit(f"{shown(name)} is {size} bytes, over the {limit} a reader takes")
        try:
            buf = target.get(size)
        except BaseException:
            body.close()
            raise
        if buf is None:
            body.close()
            return None  # it changed size under a buffer that alloc gave: a miss
        if size <= opts.ranged_get_threshold:  # the common case: this response is the object
            async with asyncio.timeout_at(deadline):
                await read_body_into(body, buf, where)
            return buf
        first = min(opts.range_size, size)
        etag = resp["ETag"]

        async def read_first() -> None:
            async with asyncio.timeout_at(deadline):
                await read_body_into(body, buf[:first], where, rest="drop")

        def read_range(lo: int, hi: int) -> Any:
            job = lambda: _read_range(client, s3, name, etag, buf, lo, hi, where)  # noqa: E731
            return limited(client.slots, job)

        # The first body is already on its way: it takes no slot (it must not wait for one).
        ranges = spans(first, size, opts.range_size)
        try:
            await run_all([read_first, *(read_range(lo, hi) for lo, hi in ranges)])
        except BaseException:
            body.close()  # it may not have started
            raise
        return buf


async def _read_range(
    client: S3Client,
    s3: Any,
    name: str,
    etag: str,
    buf: memoryview,
    lo: int,
    hi: int,
    where: str,
) -> None:
    async with asyncio.timeout(client.options.request_timeout):
        try:
            resp = await s3.get_object(
                Bucket=client.bucket, Key=name, Range=f"bytes={lo}-{hi - 1}", IfMatch=etag
            )
        except ClientError as exc:
            if is_changed(exc) or is_missing(exc):
                raise ObjectChanged(f"{where}: the object changed during the read") from exc
            raise
        if int(resp["ContentLength"]) != hi - lo:
            resp["Body"].close()
            raise ObjectChanged(f"{where}: range {lo}-{hi - 1} came back with another length")
        await read_body_into(resp["Body"], buf[lo:hi], where)
