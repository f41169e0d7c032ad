"""The ``cachegen`` payload: side information, tables and rANS streams, validated on read.

Payload (little-endian)::

    u32     zlen                      bytes of the next section
    zstd    side section (zlen bytes), which decompresses to:
        bs      f32 [planes * layers]             layer steps
        cf      i8  [planes * layers * channels]  channel factors (log2 / 4)
        center  i32 [planes * layers * channels]  channel centres (on the step grid)
        tf      i8  [layers * tokens]             token factors of values (scaled layouts only)
        cls     u8  [planes * layers * channels]  channel classes (which tables)
        lengths u32 [streams]                     16-bit words of each stream
        tables  (``serde.cachegen.tables.serialize``)
    words   u16 [sum(lengths)]        the streams, one after the other

Every size but the tables' follows from the frame (shape, memory format, the ``block``
param), so a reader checks the section sizes and every value's range before it decodes:
a hostile payload is a ``CorruptObject``, never an out-of-range read or an oversized buffer.
The side section is small (a few bytes per channel and token) and mostly small integers;
zstd halves it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gateway.errors import CorruptObject
from serde.cachegen.model import (
    BS_LOG_MAX,
    CENTER_LIMIT,
    CSTEP_LOG_MAX,
    TF_LIMIT,
    Geometry,
    Side,
)
from serde.cachegen.tables import NCLS, NCTX, NSYM, TableError, Tables, deserialize, serialize

ZSTD_LEVEL = 3


def _zstd() -> Any:
    try:
        import zstandard
    except ModuleNotFoundError as exc:  # pragma: no cover - the codecs extra installs it
        from gateway.errors import MissingDependency

        raise MissingDependency(
            "codec 'cachegen' needs zstandard: pip install 'kvgate[zstd]'"
        ) from exc
    return zstandard


def _fixed_sizes(g: Geometry) -> list[tuple[str, np.dtype[Any], int]]:
    pld = g.planes * g.layers * g.channels
    return [
        ("bs", np.dtype("<f4"), g.planes * g.layers),
        ("cf", np.dtype("i1"), pld),
        ("center", np.dtype("<i4"), pld),
        ("tf", np.dtype("i1"), g.layers * g.tokens if g.scaled else 0),
        ("cls", np.dtype("u1"), pld),
        ("lengths", np.dtype("<u4"), g.streams),
    ]


def max_side_bytes(g: Geometry) -> int:
    fixed = sum(dt.itemsize * n for _, dt, n in _fixed_sizes(g))
    return fixed + 2 + g.planes * NCLS * NCTX * (4 + NSYM)


def pack(g: Geometry, side: Side, lengths: np.ndarray[Any, Any], tables: Tables) -> bytes:
    """The payload head (``zlen`` and the side section); the words follow it."""
    parts = [
        side.bs.astype("<f4").tobytes(),
        side.cf.astype("i1").tobytes(),
        side.center.astype("<i4").tobytes(),
        side.tf.astype("i1").tobytes() if g.scaled else b"",
        side.cls.astype("u1").tobytes(),
        lengths.astype("<u4").tobytes(),
        serialize(tables),
    ]
    section = _zstd().ZstdCompressor(level=ZSTD_LEVEL).compress(b"".join(parts))
    return len(section).to_bytes(4, "little") + bytes(section)


@dataclass(frozen=True, slots=True)
class Parsed:
    side: Side
    lengths: np.ndarray[Any, Any]  # [S] int64
    offsets: np.ndarray[Any, Any]  # [S + 1] int64, in words
    tables: Tables
    words: np.ndarray[Any, Any]  # [W] uint16 (an aligned copy)


def _bad(what: str) -> CorruptObject:
    return CorruptObject(f"cachegen payload: {what}")


def _inflate(section: memoryview, limit: int) -> bytes:
    zstandard = _zstd()
    try:
        params = zstandard.get_frame_parameters(section)
        if params.content_size > limit:  # also catches an unknown size (2**64 - 1)
            raise _bad("side section declares too many bytes")
        dobj = zstandard.ZstdDecompressor().decompressobj()
        data: bytes = dobj.decompress(section)
    except zstandard.ZstdError as exc:
        raise _bad(f"side section does not decompress: {exc}") from None
    if not dobj.eof or dobj.unused_data or len(data) != params.content_size:
        raise _bad("side section is truncated or has trailing bytes")
    return data


def unpack(g: Geometry, payload: memoryview) -> Parsed:
    """Parse and validate a payload for geometry ``g``; ``CorruptObject`` if anything is off."""
    if payload.nbytes < 4:
        raise _bad("truncated")
    zlen = int.from_bytes(payload[:4], "little")
    if zlen > payload.nbytes - 4:
        raise _bad("side section is truncated")
    data = _inflate(payload[4 : 4 + zlen], max_side_bytes(g))
    pos, arrays = 0, {}
    for name, dt, n in _fixed_sizes(g):
        end = pos + dt.itemsize * n
        if end > len(data):
            raise _bad("side section is truncated")
        arrays[name] = np.frombuffer(data, dt, n, pos)
        pos = end
    try:
        tables = deserialize(memoryview(data)[pos:], g.planes)
    except TableError as exc:
        raise _bad(str(exc)) from None
    side = _side(g, arrays)
    lengths = arrays["lengths"].astype(np.int64)
    if lengths.size and (lengths.min() < 2 or lengths.max() > g.capacity):
        raise _bad("a stream length is out of range")
    offsets = np.zeros(g.streams + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    rest = payload.nbytes - 4 - zlen
    if rest != 2 * int(offsets[-1]):
        raise _bad(f"{rest} bytes of streams, expected {2 * int(offsets[-1])}")
    words = np.frombuffer(payload, "<u2", int(offsets[-1]), 4 + zlen).astype(np.uint16)
    return Parsed(side, lengths, offsets, tables, words)


def _side(g: Geometry, a: dict[str, np.ndarray[Any, Any]]) -> Side:
    bs = a["bs"].astype(np.float32).reshape(g.planes, g.layers)
    if not np.all(np.isfinite(bs)) or np.any(bs <= 0):
        raise _bad("a layer step is not a positive number")
    lb = np.log2(bs.astype(np.float64))
    if np.any(np.abs(lb) > BS_LOG_MAX):
        raise _bad("a layer step is out of range")
    pld = (g.planes, g.layers, g.channels)
    cf = a["cf"].reshape(pld).astype(np.int8)
    if np.any(np.abs(lb[:, :, None] + cf / 4.0) > CSTEP_LOG_MAX):
        raise _bad("a channel step is out of range")
    center = a["center"].reshape(pld).astype(np.int32)
    if np.any(np.abs(center.astype(np.int64)) > CENTER_LIMIT):
        raise _bad("a channel centre is out of range")
    tf = a["tf"].reshape(-1, g.tokens).astype(np.int8)
    if np.any(np.abs(tf.astype(np.int64)) > TF_LIMIT):
        raise _bad("a token factor is out of range")
    cls = a["cls"].reshape(pld).astype(np.uint8)
    if np.any(cls >= NCLS):
        raise _bad("a channel class is out of range")
    return Side(bs, cf, center, tf, cls)
