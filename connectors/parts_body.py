"""A request body made of views of the caller's buffers, for the aiohttp-based object stores."""

from __future__ import annotations

from collections.abc import Sequence

from aiohttp.abc import AbstractStreamWriter
from aiohttp.payload import Payload


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
