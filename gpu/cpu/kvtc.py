"""numba kernels of the ``kvtc`` coefficient stream (``serde.kvtc.stream`` is the spec, coded
there with the generic ``gpu.reference.rans`` / ``gpu.cpu.rans`` coders).

Fused per stream: the split of a coefficient into its coded part (``q >> shift``), its table
index or the escape, and the rANS step, with no per-symbol table array; decoding writes the
coefficient (times ``2**shift``) as float32 straight away, NaN where an escape's value must be
filled in from the payload. The coder's arithmetic is ``gpu.cpu.rans``'s (same words).
Kernels are ``nogil`` over a range of streams, split over the cores by ``gpu.dispatch``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from gpu import dispatch
from gpu.cpu.rans import compact, decoder_entries, encoder_entries
from gpu.cpu.rans_words import MASK16, PRECU, RENORM, SLOT, TOTAL, W16, W32, L


@njit(nogil=True, cache=False)
def _encode_range(
    q: Any,
    shift: Any,
    rng: Any,
    tid: Any,
    block: Any,
    ent: Any,
    buf: Any,
    lengths: Any,
    escapes: Any,
    s0: Any,
    s1: Any,
) -> None:
    n, tokens = q.shape
    cap = buf.shape[1]
    for s in range(s0, s1):
        out = buf[s]
        x = L
        pos = cap
        nesc = 0
        for c in range(min(n, (s + 1) * block) - 1, s * block - 1, -1):
            sh, r, t_id = shift[c], rng[c], tid[c]
            for t in range(tokens - 1, -1, -1):
                hi = np.int64(q[c, t]) >> sh
                k = hi + r + 1
                if hi < -r or hi > r:
                    k = 0
                    nesc += 1
                cm = np.uint64(ent[t_id, k, 3])
                if x >= ((TOTAL - cm) << RENORM):
                    pos -= 1
                    out[pos] = np.uint16(x & MASK16)
                    x >>= W16
                qq = (((x * np.uint64(ent[t_id, k, 0])) >> W32) + x) >> np.uint64(ent[t_id, k, 1])
                x = x + np.uint64(ent[t_id, k, 2]) + qq * cm
        out[pos - 1] = np.uint16(x & MASK16)
        out[pos - 2] = np.uint16(x >> W16)
        lengths[s] = cap - pos + 2
        escapes[s] = nesc


@njit(nogil=True, cache=False)
def _decode_range(
    words: Any,
    offsets: Any,
    shift: Any,
    rng: Any,
    tid: Any,
    block: Any,
    dent: Any,
    lut: Any,
    out: Any,
    ok: Any,
    escapes: Any,
    s0: Any,
    s1: Any,
) -> None:
    n, tokens = out.shape
    for s in range(s0, s1):
        nesc = 0
        pos, end = offsets[s], offsets[s + 1]
        good = end - pos >= 2
        x = L
        if good:
            x = (np.uint64(words[pos]) << W16) | np.uint64(words[pos + 1])
            pos += 2
        for c in range(s * block, min(n, (s + 1) * block)):
            sh, r, t_id = shift[c], rng[c], tid[c]
            scale = np.float32(2.0**sh)
            for t in range(tokens):
                slot = x & SLOT
                k = np.int64(lut[t_id, slot])
                e = np.uint64(dent[t_id, k])
                x = (e & MASK16) * (x >> PRECU) + slot - (e >> W16)
                if x < L:
                    if pos < end:
                        x = (x << W16) | np.uint64(words[pos])
                        pos += 1
                    else:
                        good = False
                if k:
                    out[c, t] = np.float32(k - r - 1) * scale
                else:
                    out[c, t] = np.float32(np.nan)
                    nesc += 1
        ok[s] = good and x == L and pos == end
        escapes[s] = nesc


def encode(
    q: np.ndarray[Any, Any],
    shift: np.ndarray[Any, Any],
    rng: np.ndarray[Any, Any],
    tid: np.ndarray[Any, Any],
    block: int,
    freq: np.ndarray[Any, Any],
    cum: np.ndarray[Any, Any],
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """``(words, lengths, escapes per stream)`` of ``q`` ``[N, T]`` int32 (C order)."""
    n, tokens = q.shape
    streams = -(-n // block)
    buf = np.empty((streams, block * tokens + 2), np.uint16)
    lengths = np.zeros(streams, np.int64)
    escapes = np.zeros(streams, np.int64)
    ent = encoder_entries(freq, cum)
    args = (q, shift, rng, tid, block, ent, buf, lengths, escapes)
    dispatch.parallel(lambda a, b: _encode_range(*args, a, b), streams)
    return compact(buf, lengths), lengths, escapes


def decode(
    words: np.ndarray[Any, Any],
    offsets: np.ndarray[Any, Any],
    shape: tuple[int, int],
    shift: np.ndarray[Any, Any],
    rng: np.ndarray[Any, Any],
    tid: np.ndarray[Any, Any],
    block: int,
    freq: np.ndarray[Any, Any],
    cum: np.ndarray[Any, Any],
    lut: np.ndarray[Any, Any],
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], int]:
    """``(coded parts * 2**shift as float32 [N, T] with NaN at escapes, whether each stream
    decoded, escapes in all)``."""
    n = shape[0]
    streams = -(-n // block)
    out = np.empty(shape, np.float32)
    ok = np.zeros(streams, np.bool_)
    escapes = np.zeros(streams, np.int64)
    dent = decoder_entries(freq, cum)
    args = (words, offsets, shift, rng, tid, block, dent, lut, out, ok, escapes)
    dispatch.parallel(lambda a, b: _decode_range(*args, a, b), streams)
    return out, ok, int(escapes.sum())


@njit(nogil=True, cache=False)
def _pack_low(q: Any, shift: Any, out: Any) -> None:
    """Low bits of shifted components, component after component, LSB first."""
    bit = 0
    n, tokens = q.shape
    for c in range(n):
        sh = shift[c]
        if sh == 0:
            continue
        for t in range(tokens):
            v = np.int64(q[c, t])
            for b in range(sh):
                if (v >> b) & 1:
                    out[bit >> 3] |= np.uint8(1 << (bit & 7))
                bit += 1


@njit(nogil=True, cache=False)
def _add_low(out: Any, raw: Any, shift: Any) -> None:
    bit = 0
    n, tokens = out.shape
    for c in range(n):
        sh = shift[c]
        if sh == 0:
            continue
        for t in range(tokens):
            v = np.int64(0)
            for b in range(sh):
                v |= ((np.int64(raw[bit >> 3]) >> (bit & 7)) & 1) << b
                bit += 1
            out[c, t] += np.float32(v)


@njit(nogil=True, cache=False)
def _escapes(q: Any, shift: Any, rng: Any, out: Any) -> None:
    k = 0
    n, tokens = q.shape
    for c in range(n):
        for t in range(tokens):
            hi = np.int64(q[c, t]) >> shift[c]
            if hi < -rng[c] or hi > rng[c]:
                out[k] = hi
                k += 1


@njit(nogil=True, cache=False)
def _fill_escapes(out: Any, escapes: Any, shift: Any) -> None:
    k = 0
    n, tokens = out.shape
    for c in range(n):
        for t in range(tokens):
            if np.isnan(out[c, t]):
                out[c, t] = np.float32(np.float64(escapes[k]) * 2.0 ** shift[c])
                k += 1


def pack_low(q: np.ndarray[Any, Any], shift: np.ndarray[Any, Any]) -> bytes:
    """``serde.kvtc.stream``'s low-bit section of ``q`` ``[N, T]`` int32."""
    nbits = int(shift.sum()) * q.shape[1]
    out = np.zeros((nbits + 7) // 8, np.uint8)
    _pack_low(q, shift, out)
    return out.tobytes()


def add_low(
    out: np.ndarray[Any, Any], raw: np.ndarray[Any, Any], shift: np.ndarray[Any, Any]
) -> None:
    """Add the low bits (``raw``: the section, checked long enough) to ``out`` ``[N, T]``."""
    _add_low(out, raw, shift)


def escapes_of(
    q: np.ndarray[Any, Any], shift: np.ndarray[Any, Any], rng: np.ndarray[Any, Any], count: int
) -> np.ndarray[Any, Any]:
    out = np.zeros(count, np.int32)
    _escapes(q, shift, rng, out)
    return out


def fill_escapes(
    out: np.ndarray[Any, Any], escapes: np.ndarray[Any, Any], shift: np.ndarray[Any, Any]
) -> None:
    """Replace the NaNs of ``out`` (as many as ``escapes``, checked) in C order."""
    _fill_escapes(out, escapes, shift)
