"""Reading one object into one buffer: one GET when small, parallel ranges when large.

The first request is a plain media GET: its headers give the size (and, on GCS, the object's
generation) before any body byte is read, so the buffer is allocated at once and the body
streams straight into it. Over ``ranged_get_threshold`` the first response supplies only the
first ``range_size`` bytes and is then dropped, while the rest comes in parallel ranges
(``max_concurrency`` at once), each pinned to that generation (``generation=`` in the query):
an overwrite in between makes GCS answer 404 for the old generation, and the read starts
again (``CHANGE_RETRIES`` times at most). A server that sends no generation (the emulator the
tests use) gets unpinned ranges; each range's length is still checked.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from connectors.fanout import limited, run_all, spans
from connectors.gcs.client import GcsClient
from connectors.gcs.errors import gcs_errors, is_missing
from connectors.object_names import shown
from connectors.read_target import ReadTarget
from gateway.connector import Allocator, read_limit
from gateway.errors import OverReadLimit, Unavailable

CHANGE_RETRIES = 3
GENERATION = "x-goog-generation"


class ObjectChanged(Unavailable):
    """The object was overwritten or deleted between two ranges of one read."""


async def download(client: GcsClient, name: str, alloc: Allocator) -> memoryview | None:
    """The object ``name`` in a buffer from ``alloc`` (or a new one); None on a miss."""
    target = ReadTarget(alloc)
    for attempt in range(CHANGE_RETRIES):
        try:
            return await _read_once(client, name, target)
        except ObjectChanged:
            if attempt == CHANGE_RETRIES - 1:
                raise
    raise AssertionError("unreachable")


async def _get(
    client: GcsClient, name: str, headers: dict[str, str], params: dict[str, str]
) -> aiohttp.ClientResponse:
    session = await client.session()
    auth = await client.headers()
    resp: aiohttp.ClientResponse = await session.get(
        client.object_url(name),
        headers={**auth, **headers},
        timeout=client.options.request_timeout,
        params={"alt": "media", **params},
    )
    return resp


async def read_into(resp: aiohttp.ClientResponse, dst: memoryview, where: str) -> None:
    """Stream the body into ``dst``; it must be exactly as long, except that a longer one is
    cut (and its connection closed) once ``dst`` is full."""
    pos, size = 0, dst.nbytes
    try:
        while pos < size:
            chunk = await resp.content.read(min(size - pos, 1 << 20))
            if not chunk:
                raise Unavailable(f"{where}: the body ended after {pos} of {size} bytes")
            dst[pos : pos + len(chunk)] = chunk
            pos += len(chunk)
        if not resp.content.at_eof():
            resp.close()  # the rest is not wanted
    except BaseException:
        resp.close()
        raise
    resp.release()


async def _read_once(client: GcsClient, name: str, target: ReadTarget) -> memoryview | None:
    opts = client.options
    where = f"{client.where} GET {shown(name)}"
    with gcs_errors(where, client.bucket):
        deadline = asyncio.get_running_loop().time() + opts.request_timeout
        try:
            async with asyncio.timeout_at(deadline):
                resp = await _get(client, name, {}, {})
        except aiohttp.ClientResponseError as exc:
            if is_missing(exc):
                return None
            raise
        try:
            size = _length(resp, where)
            limit = read_limit()
            if limit is not None and size > limit:  # stored there by anyone: never allocated
                raise OverReadLimit(f"{shown(name)} is {size} bytes, over the {limit} allowed")
            buf = target.get(size)
        except BaseException:
            resp.close()
            raise
        if buf is None:
            resp.close()
            return None  # it changed size under a buffer that alloc gave: a miss
        if size <= opts.ranged_get_threshold:
            async with asyncio.timeout_at(deadline):
                await read_into(resp, buf, where)
            return buf
        first = min(opts.range_size, size)
        generation = resp.headers.get(GENERATION)
        pinned = {"generation": generation} if generation else {}
        slots = asyncio.Semaphore(opts.max_concurrency)

        async def read_first() -> None:
            async with asyncio.timeout_at(deadline):
                await read_into(resp, buf[:first], where)

        def read_range(lo: int, hi: int) -> Any:
            async def job() -> None:
                await _read_range(client, name, pinned, buf, lo, hi, where)

            return limited(slots, job)

        try:
            await run_all(
                [
                    read_first,
                    *(read_range(lo, hi) for lo, hi in spans(first, size, opts.range_size)),
                ]
            )
        finally:
            resp.close()
        return buf


def _length(resp: aiohttp.ClientResponse, where: str) -> int:
    if resp.content_length is None:
        raise Unavailable(f"{where}: GCS sent no Content-Length")
    return int(resp.content_length)


async def _read_range(
    client: GcsClient,
    name: str,
    pinned: dict[str, str],
    buf: memoryview,
    lo: int,
    hi: int,
    where: str,
) -> None:
    async with asyncio.timeout(client.options.request_timeout):
        try:
            resp = await _get(client, name, {"Range": f"bytes={lo}-{hi - 1}"}, pinned)
        except aiohttp.ClientResponseError as exc:
            if is_missing(exc):
                raise ObjectChanged(f"{where}: the object changed during the read") from exc
            raise
        if resp.status != 206 or _length(resp, where) != hi - lo:
            resp.close()
            raise ObjectChanged(f"{where}: range {lo}-{hi - 1} came back as another object")
        await read_into(resp, buf[lo:hi], where)
