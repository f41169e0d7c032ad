"""Static rANS on the CPU (numba): symbol tables in the kernels' form, and stream kernels.

The same coder as ``gpu.reference.rans`` (read it for the definition), one stream at a time.
``encoder_entries`` / ``decoder_entries`` pack a symbol's constants so that a coding step is
one table load and no division; the CacheGen kernels (``gpu.cpu.cachegen_kernels``) use them in
their own fused loops. ``encode_streams`` / ``decode_streams`` code streams whose tables are
known per position (the generic form, used by the tests); ``compact`` joins encoded streams.

Kernels are ``nogil`` and run over a range of streams, so ``gpu.dispatch`` splits a call over
the cores. Importing this module imports numba.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from gpu import dispatch
from serde.cachegen.tables import NCLS, NCTX, NSYM, PREC, QMAX, THRESHOLDS, Tables, context_of

RANS_L = np.uint64(1 << 16)
SHIFT = np.uint64(PREC)
RENORM_SHIFT = np.uint64(32 - PREC)
WORD_SHIFT = np.uint64(16)
WORD_MASK = np.uint64(0xFFFF)
SLOT_MASK = np.uint64((1 << PREC) - 1)


def encoder_entries(freq: np.ndarray[Any, Any], cum: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``[tables, symbols, 4]`` uint32 ``(m, l, cum, 2**PREC - freq)`` per symbol.

    The encoder's ``x // f`` is ``((x * m >> 32) + x) >> l`` with ``l = ceil(log2 f)`` and
    ``m = ceil(2**(32 + l) / f) - 2**32`` (Granlund and Montgomery's round-up reciprocal, exact
    for every 32-bit ``x``; the sum fits in 64 bits), and the new state is ``x + cum + (x // f)
    * (2**PREC - f)``, the same as ``(x // f << PREC) + x % f + cum`` without a division."""
    f = freq.astype(np.int64)
    out = np.zeros((*freq.shape, 4), np.uint32)
    out[..., 0] = _RECIPROCAL[f]
    out[..., 1] = _SHIFT[f]
    out[..., 2] = cum
    out[..., 3] = (1 << PREC) - f
    return out


def _reciprocals() -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """``(m, l)`` of every frequency ``0..2**PREC`` (0 for the unused frequency 0)."""
    f = np.arange((1 << PREC) + 1, dtype=np.int64)
    safe = np.maximum(f, 1)
    shift = np.array([(int(v) - 1).bit_length() for v in safe], np.int64)  # ceil(log2 f)
    m = ((np.int64(1) << (32 + shift)) + safe - 1) // safe - (np.int64(1) << 32)
    return np.where(f > 0, m, 0).astype(np.uint32), shift.astype(np.uint32)


_RECIPROCAL, _SHIFT = _reciprocals()


def encoder_table(tables: Tables, planes: int) -> np.ndarray[Any, Any]:
    """``encoder_entries`` with a row for every table id (zero rows for the unused ones)."""
    out = np.zeros((planes * NCLS * NCTX, NSYM, 4), np.uint32)
    out[tables.ids] = encoder_entries(tables.freq, tables.cum)
    return out


def by_id(tables: Tables, planes: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """``(freq, cum)`` with a row for every table id (zero rows for the unused ones)."""
    n = planes * NCLS * NCTX
    freq = np.zeros((n, NSYM), np.int64)
    cum = np.zeros((n, NSYM), np.int64)
    freq[tables.ids] = tables.freq
    cum[tables.ids] = tables.cum
    return freq, cum


def context_lut(tables: Tables, planes: int) -> np.ndarray[Any, Any]:
    """``[table ids, 2**PREC]`` uint16: the symbol index of each slot, and in the high byte the
    context that symbol gives the next token (so the decoder looks both up at once)."""
    n = planes * NCLS * NCTX
    out = np.zeros((n, 1 << PREC), np.uint16)
    q = np.arange(NSYM) - QMAX
    for d, t in enumerate(tables.ids):
        k = (t // NCTX) % NCLS
        ctx = context_of(q, THRESHOLDS[k, 0], THRESHOLDS[k, 1])
        entry = np.arange(NSYM, dtype=np.uint16) | (ctx.astype(np.uint16) << 8)
        out[t] = np.repeat(entry, tables.freq[d])
    return out


def decoder_entries(freq: np.ndarray[Any, Any], cum: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``[tables, symbols]`` uint32 ``freq | cum << 16`` (one load per decoded symbol)."""
    return (freq.astype(np.uint32) | (cum.astype(np.uint32) << 16)).astype(np.uint32)


@njit(nogil=True, cache=False)
def _encode_range(
    sym: Any, tbl: Any, count: Any, ent: Any, buf: Any, lengths: Any, s0: Any, s1: Any
) -> None:
    cap = buf.shape[1]
    for s in range(s0, s1):
        x = RANS_L
        pos = cap
        for i in range(count[s] - 1, -1, -1):
            t, k = tbl[s, i], sym[s, i]
            cm = np.uint64(ent[t, k, 3])
            if x >= ((np.uint64(1 << PREC) - cm) << RENORM_SHIFT):
                pos -= 1
                buf[s, pos] = np.uint16(x & WORD_MASK)
                x >>= WORD_SHIFT
            q = (((x * np.uint64(ent[t, k, 0])) >> np.uint64(32)) + x) >> np.uint64(ent[t, k, 1])
            x = x + np.uint64(ent[t, k, 2]) + q * cm
        buf[s, pos - 1] = np.uint16(x & WORD_MASK)
        buf[s, pos - 2] = np.uint16(x >> WORD_SHIFT)
        lengths[s] = cap - pos + 2


@njit(nogil=True, cache=False)
def _compact_range(buf: Any, lengths: Any, offsets: Any, out: Any, s0: Any, s1: Any) -> None:
    cap = buf.shape[1]
    for s in range(s0, s1):
        n = lengths[s]
        out[offsets[s] : offsets[s] + n] = buf[s, cap - n :]


@njit(nogil=True, cache=False)
def _decode_range(
    words: Any,
    offsets: Any,
    tbl: Any,
    count: Any,
    dent: Any,
    lut: Any,
    sym: Any,
    ok: Any,
    s0: Any,
    s1: Any,
) -> None:
    for s in range(s0, s1):
        pos, end = offsets[s], offsets[s + 1]
        good = end - pos >= 2
        x = RANS_L
        if good:
            x = (np.uint64(words[pos]) << WORD_SHIFT) | np.uint64(words[pos + 1])
            pos += 2
        for i in range(count[s]):
            t = tbl[s, i]
            slot = x & SLOT_MASK
            k = np.int64(lut[t, slot])
            e = np.uint64(dent[t, k])
            x = (e & WORD_MASK) * (x >> SHIFT) + slot - (e >> WORD_SHIFT)
            if x < RANS_L:
                if pos < end:
                    x = (x << WORD_SHIFT) | np.uint64(words[pos])
                    pos += 1
                else:
                    good = False
            sym[s, i] = k
        ok[s] = good and x == RANS_L and pos == end


def compact(buf: np.ndarray[Any, Any], lengths: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The streams' words one after the other (``buf`` rows hold them right-aligned)."""
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    out = np.empty(int(offsets[-1]), np.uint16)
    dispatch.parallel(lambda a, b: _compact_range(buf, lengths, offsets, out, a, b), len(lengths))
    return out


def encode_streams(
    sym: np.ndarray[Any, Any],
    tbl: np.ndarray[Any, Any],
    count: np.ndarray[Any, Any],
    freq: np.ndarray[Any, Any],
    cum: np.ndarray[Any, Any],
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Same contract as ``gpu.reference.rans.encode`` on numpy arrays."""
    streams, width = sym.shape
    buf = np.empty((streams, width + 2), np.uint16)
    lengths = np.zeros(streams, np.int64)
    args = (sym.astype(np.int64), tbl.astype(np.int64), count.astype(np.int64))
    ent = encoder_entries(freq, cum)
    dispatch.parallel(lambda a, b: _encode_range(*args, ent, buf, lengths, a, b), streams)
    return compact(buf, lengths), lengths


def decode_streams(
    words: np.ndarray[Any, Any],
    offsets: np.ndarray[Any, Any],
    tbl: np.ndarray[Any, Any],
    count: np.ndarray[Any, Any],
    freq: np.ndarray[Any, Any],
    cum: np.ndarray[Any, Any],
    lut: np.ndarray[Any, Any],
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Same contract as ``gpu.reference.rans.decode`` on numpy arrays."""
    streams = tbl.shape[0]
    sym = np.zeros(tbl.shape, np.int64)
    ok = np.zeros(streams, np.bool_)
    w = words.astype(np.uint16)
    args = (offsets.astype(np.int64), tbl.astype(np.int64), count.astype(np.int64))
    tables = (decoder_entries(freq, cum), lut.astype(np.uint8))
    dispatch.parallel(lambda a, b: _decode_range(w, *args, *tables, sym, ok, a, b), streams)
    return sym, ok
