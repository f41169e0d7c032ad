"""The ``kvtc`` coefficient stream: quantized coefficients <-> payload sections.

Coefficients arrive as ``q`` ``[N, T]`` (N components over every (plane, group), T coded
tokens). Each component has a table, a shift and a range from the calibration
(``Loaded.coords``). ``q >> shift`` is coded with static rANS; streams are blocks of
``block`` consecutive components, each component's tokens in order (the calibration's tables
are per component class, so no context is needed). Sections, little-endian::

    lengths  u32 [streams]      16-bit words of each stream
    escapes  u32 count, i32 [count]   coded values outside their table's range, in order
    low bits (ceil(T * sum(shift) / 8) bytes)   ``q & (2**shift - 1)``, LSB first
    words    u16 [sum(lengths)]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gateway.errors import CorruptObject
from gpu import dispatch
from serde.kvtc.calibration import Loaded
from serde.kvtc.symbols import symbol_index
from serde.tensors import PayloadReader

STREAM_SYMBOLS = 1 << 14  # symbols per stream (many streams: both cores, and GPU threads)
MAX_ESCAPES = 1 << 28


def default_block(tokens: int) -> int:
    return max(1, STREAM_SYMBOLS // max(1, tokens))


@dataclass(frozen=True, slots=True)
class Layout:
    components: int
    tokens: int
    block: int

    @property
    def streams(self) -> int:
        return -(-self.components // self.block)

    def counts(self) -> np.ndarray[Any, Any]:
        s = np.arange(self.streams, dtype=np.int64)
        return np.minimum(self.block, self.components - s * self.block) * self.tokens

    def per_symbol(self, per_component: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """A per-component value spread over ``[streams, block * tokens]`` (padded)."""
        padded = np.zeros(self.streams * self.block, np.int64)
        padded[: self.components] = per_component
        return np.repeat(padded, self.tokens).reshape(self.streams, self.block * self.tokens)


def _kernels() -> Any:
    """The numba kernels, or None for the reference (``KVGATE_KERNELS=reference``, no numba)."""
    if dispatch.forced_reference() or not dispatch.has_numba():
        return None
    from gpu.cpu import kvtc

    return kvtc


def encode(
    loaded: Loaded, planes: tuple[int, ...], q: np.ndarray[Any, Any], block: int
) -> list[bytes | memoryview]:
    """The sections of ``q`` ``[N, T]`` int32 (N: the components of ``planes``)."""
    c = loaded.coords(planes)
    lay = Layout(c.count, q.shape[1], block)
    tables = loaded.tables
    kernels = _kernels()
    if kernels is not None:
        q = np.ascontiguousarray(q, np.int32)
        words, lengths, escaped = kernels.encode(
            q, c.shift, c.rng, c.tid, block, tables.freq, tables.cum
        )
        n_esc = int(escaped.sum())
        escapes = kernels.escapes_of(q, c.shift, c.rng, n_esc) if n_esc else np.zeros(0, "<i4")
        low = kernels.pack_low(q, c.shift)
    else:
        q64 = q.astype(np.int64)
        idx = symbol_index(q64 >> c.shift[:, None], c.rng[:, None])
        escapes = _escapes(q64, c)
        sym = np.zeros((lay.streams * lay.block, lay.tokens), np.int64)
        sym[: lay.components] = idx
        sym = sym.reshape(lay.streams, -1)
        words, lengths = _reference_encode(sym, lay.per_symbol(c.tid), lay.counts(), tables)
        low = _pack_low(q, c.shift)
    return [
        np.asarray(lengths, "<u4").tobytes(),
        np.uint32(len(escapes)).tobytes() + escapes.astype("<i4").tobytes(),
        low,
        np.ascontiguousarray(words, "<u2").data.cast("B"),
    ]


def _escapes(q: np.ndarray[Any, Any], c: Any) -> np.ndarray[Any, Any]:
    """The coded values outside their table's range, in stream (C) order."""
    hi = q.astype(np.int64) >> c.shift[:, None]
    out: np.ndarray[Any, Any] = hi[(hi < -c.rng[:, None]) | (hi > c.rng[:, None])]
    return out


def decode(
    loaded: Loaded, planes: tuple[int, ...], reader: PayloadReader, tokens: int, block: int
) -> np.ndarray[Any, Any]:
    """The coefficients ``[N, tokens]`` as float32 from the reader's next sections;
    ``CorruptObject`` if they do not decode."""
    c = loaded.coords(planes)
    lay = Layout(c.count, tokens, block)
    lengths = reader.array("<u4", lay.streams).astype(np.int64)
    n_esc = int(reader.array("<u4", 1)[0])
    if n_esc > min(MAX_ESCAPES, c.count * tokens):
        raise CorruptObject("kvtc payload: too many escapes")
    escapes = reader.array("<i4", n_esc)
    raw_low = reader.array(np.uint8, (int(c.shift.sum()) * tokens + 7) // 8)
    offsets = np.zeros(lay.streams + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    words = reader.array("<u2", int(offsets[-1]))
    tables = loaded.tables
    kernels = _kernels()
    if kernels is not None:
        out, ok, found = kernels.decode(
            words, offsets, (c.count, tokens), c.shift, c.rng, c.tid, block,
            tables.freq, tables.cum, loaded.lut,
        )  # fmt: skip
        _check(ok)
        if found != n_esc:
            raise CorruptObject("kvtc payload: escape count disagrees with the streams")
        if n_esc:
            kernels.fill_escapes(out, escapes, c.shift)
        if raw_low.size:
            kernels.add_low(out, raw_low, c.shift)
        result: np.ndarray[Any, Any] = out
        return result
    sym, ok = _reference_decode(
        words, offsets, lay.per_symbol(c.tid), lay.counts(), tables, loaded.lut
    )
    _check(ok)
    idx = sym.reshape(-1)[: c.count * tokens].reshape(c.count, tokens)
    hi = idx - c.rng[:, None] - 1
    escaped = idx == 0
    if int(escaped.sum()) != n_esc:
        raise CorruptObject("kvtc payload: escape count disagrees with the streams")
    hi[escaped] = escapes
    low_rows, low = _unpack_low(raw_low, c.shift, tokens)
    q: np.ndarray[Any, Any] = hi << c.shift[:, None]
    q[low_rows] |= low
    return q.astype(np.float32)


def _check(ok: np.ndarray[Any, Any]) -> None:
    if not bool(np.all(ok)):
        raise CorruptObject("kvtc payload: a stream does not decode")


def _pack_low(q: np.ndarray[Any, Any], shift: np.ndarray[Any, Any]) -> bytes:
    rows = np.flatnonzero(shift > 0)
    if rows.size == 0:
        return b""
    s = shift[rows]
    width = int(s.max())
    bits = (q[rows][:, :, None] >> np.arange(width)) & 1  # [n, T, width]
    keep = np.broadcast_to(np.arange(width) < s[:, None, None], bits.shape)
    return np.packbits(bits[keep].astype(np.uint8), bitorder="little").tobytes()


def _unpack_low(
    raw: np.ndarray[Any, Any], shift: np.ndarray[Any, Any], tokens: int
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """``(rows, their low bits [rows, tokens])``: the components with a shift."""
    rows = np.flatnonzero(shift > 0)
    if rows.size == 0:
        return rows, np.zeros((0, tokens), np.int64)
    s = shift[rows]
    nbits = int(s.sum()) * tokens
    bits = np.unpackbits(raw, bitorder="little")[:nbits]
    width = int(s.max())
    full = np.zeros((len(rows), tokens, width), np.int64)
    keep = np.broadcast_to(np.arange(width) < s[:, None, None], full.shape)
    full[keep] = bits
    return rows, (full << np.arange(width)).sum(axis=2)


def _reference_encode(
    sym: np.ndarray[Any, Any], tbl: np.ndarray[Any, Any], count: np.ndarray[Any, Any], tables: Any
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    import torch

    from gpu.reference import rans

    t = torch.from_numpy
    words, lengths = rans.encode(
        t(sym), t(tbl), t(count), t(tables.freq.astype(np.int64)), t(tables.cum.astype(np.int64))
    )
    return words.numpy().astype(np.uint16), lengths.numpy()


def _reference_decode(
    words: np.ndarray[Any, Any],
    offsets: np.ndarray[Any, Any],
    tbl: np.ndarray[Any, Any],
    count: np.ndarray[Any, Any],
    tables: Any,
    lut: np.ndarray[Any, Any],
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    import torch

    from gpu.reference import rans

    t = torch.from_numpy
    sym, ok = rans.decode(
        t(words.astype(np.int64)),
        t(offsets),
        t(tbl),
        t(count),
        t(tables.freq.astype(np.int64)),
        t(tables.cum.astype(np.int64)),
        t(lut.astype(np.int64)),
    )
    return sym.numpy(), ok.numpy()
