"""Pieces shared by uploads and downloads: bounded fan-out, part slicing, body streaming."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal, TypeVar

from aiohttp.abc import AbstractStreamWriter
from aiohttp.payload import Payload

from gateway.errors import Unavailable

T = TypeVar("T")


def limited(
    slots: asyncio.Semaphore, job: Callable[[], Awaitable[T]]
) -> Callable[[], Awaitable[T]]:
    """``job`` run while holding one of ``slots``."""

    async def run() -> T:
        async with slots:
            return await job()

    return run


async def run_all(jobs: Sequence[Callable[[], Awaitable[T]]]) -> list[T]:
    """Run ``jobs`` concurrently; their results in order.

    The first failure cancels the rest. Every job has finished when this returns or raises
    (also when the caller is cancelled), so none still writes into a buffer the caller owns.
    """
    if not jobs:
        return []
    tasks = [asyncio.ensure_future(job()) for job in jobs]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()  # a no-op on finished tasks
        while not all(task.done() for task in tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait(tasks)
    failed = [t for t in tasks if not t.cancelled() and t.exception() is not None]
    if failed:
        raise failed[0].exception()  # type: ignore[misc]
    return [task.result() for task in tasks]


def slice_parts(parts: Sequence[memoryview], start: int, end: int) -> list[memoryview]:
    """The pieces of the concatenation of ``parts`` between ``start`` and ``end`` (views)."""
    out: list[memoryview] = []
    offset = 0
    for part in parts:
        lo, hi = max(start, offset), min(end, offset + part.nbytes)
        if lo < hi:
            out.append(part[lo - offset : hi - offset])
        offset += part.nbytes
        if offset >= end:
            break
    return out


class PartsBody(Payload):
    """A request body made of views of the caller's buffers, never joined.

    aiohttp sends it piece by piece (and does not warn about large ``bytes`` bodies, which
    ``-W error`` would turn into failures). botocore sees a seekable file-like object: it
    reads it once to compute the SigV4 payload hash, in views, then seeks back.
    """

    _autoclose = True

    def __init__(self, pieces: Sequence[memoryview]) -> None:
        super().__init__(list(pieces))
        self._pieces: list[memoryview] = list(pieces)
        self._size = sum(p.nbytes for p in self._pieces)
        self._pos = 0

    def __len__(self) -> int:
        return self._size or 0

    # -- what aiohttp calls --------------------------------------------------------------

    async def write(self, writer: AbstractStreamWriter) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(
        self, writer: AbstractStreamWriter, content_length: int | None
    ) -> None:
        left = len(self) if content_length is None else content_length
        for piece in self._pieces:
            if left <= 0:
                break
            await writer.write(piece[:left])
            left -= piece.nbytes

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return b"".join(self._pieces).decode(encoding, errors)

    # -- what botocore calls (hashing, retries) ------------------------------------------

    def read(self, size: int = -1) -> memoryview | bytes:
        """Up to ``size`` bytes from the current position, as a view (b"" at the end)."""
        offset = 0
        for piece in self._pieces:
            if self._pos < offset + piece.nbytes:
                start = self._pos - offset
                end = piece.nbytes if size < 0 else min(piece.nbytes, start + size)
                self._pos += end - start
                return piece[start:end]
            offset += piece.nbytes
        return b""

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: len(self)}[whence]
        self._pos = min(max(base + pos, 0), len(self))
        return self._pos

    def tell(self) -> int:
        return self._pos


def spans(start: int, end: int, step: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + step, end)) for lo in range(start, end, step)]


async def read_body_into(
    body: Any, dst: memoryview, where: str, *, rest: Literal["none", "drop"] = "none"
) -> None:
    """Stream a GetObject body into ``dst``.

    With ``rest="none"`` the body must be exactly as long as ``dst``; with ``rest="drop"`` it
    may be longer, and the connection is closed once ``dst`` is full (the rest is not wanted).
    Each chunk is copied once, as aiohttp received it, straight into ``dst``; nothing builds
    the whole object in ``bytes`` first. On any failure the connection is closed, not reused.
    """
    content = getattr(body, "content", None)  # the aiohttp stream behind aiobotocore's body
    readchunk = getattr(content, "readchunk", None)
    pos, size = 0, dst.nbytes
    try:
        while True:
            if readchunk is not None:
                chunk, http_chunk_end = await readchunk()
                if not chunk and http_chunk_end:
                    continue  # the end of one HTTP chunk, not of the body
            else:  # another HTTP backend: its own read, in pieces
                chunk = await body.read(min(1 << 20, size - pos) or 1)
            if not chunk:
                break
            end = pos + len(chunk)
            if end > size:
                if rest != "drop":
                    raise Unavailable(f"{where}: S3 sent more than the {size} bytes it announced")
                dst[pos:] = memoryview(chunk)[: size - pos]
                body.close()
                return
            dst[pos:end] = chunk
            pos = end
            if pos == size and rest == "drop":
                body.close()
                return
        if pos != size:
            raise Unavailable(f"{where}: the body ended after {pos} of {size} bytes")
    except BaseException:
        body.close()
        raise
