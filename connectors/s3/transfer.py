"""Pieces shared by uploads and downloads: body streaming (fan-out and bodies are shared with
the other object-store connectors, re-exported here)."""

from __future__ import annotations

from typing import Any, Literal

from connectors.fanout import limited, run_all, slice_parts, spans
from connectors.parts_body import PartsBody
from gateway.errors import Unavailable

__all__ = [
    "PartsBody",
    "limited",
    "read_body_into",
    "run_all",
    "slice_parts",
    "spans",
]


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
