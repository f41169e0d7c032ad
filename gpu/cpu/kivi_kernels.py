"""numba kernels for KIVI: fused quantize+pack and unpack+dequantize over blocks of tokens.

The math and the payload layout are ``gpu.reference.kivi``'s (read that first); these kernels
produce the same bytes. A kernel call handles a range of units, so ranges run on the CPU
threads in parallel (``gpu.dispatch.run_chunks``; ``nogil``). A unit is a block of token rows
of one layer:

- per-channel planes (keys): the block is one group of tokens. Pass 1 converts each row and
  folds it into per-channel min/max; pass 2 converts it again, quantizes it with the per-channel
  statistics and packs it. Every inner loop runs over contiguous channels and vectorizes (the
  block's source stays in L2 between the passes).
- per-token planes (values): 16 rows per unit; each row is converted once, its groups of
  channels reduced (as order-preserving integers, which vectorizes), then quantized and packed.

Two details make the loops vectorize: helpers are inlined at numba's IR level
(``inline="always"``), and every loop indexes a *slice* taken at the row's offset, so numba's
negative-index wraparound checks vanish (indexing ``a[off + c]`` with a runtime ``off`` kept
LLVM from vectorizing and ran 10x slower).

Input and output elements are addressed as ``base + layer * sl + token * st + channel`` (element
strides of the canonical view), so every memory format is read and written in place. 16-bit
floats travel as ``uint16`` bits (``kind`` 0 float16, 1 bfloat16) and float32 as ``float32``
(``kind`` 2); the unused array is an empty dummy. With one array type per argument each kernel
compiles to exactly one specialization, once per process (about 4 s for encode, 1 s for decode
on this 2-core machine); both planes share one row loader, quantizer and packer to keep that
short.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from gpu.cpu.half import bf2f, bits_f32, f2bf, f2h, f32_bits, h2f

FP16_MAX = np.float32(65504.0)
HALF = np.float32(0.5)
ONE = np.float32(1.0)
ZERO = np.float32(0.0)
_LOW31 = np.int64(0x7FFFFFFF)


@njit(nogil=True, cache=False, inline="always")
def _load_row(src16: Any, src32: Any, kind: int, off: int, n: int, row: Any) -> int:
    """Convert ``n`` elements at ``off`` to float32 into ``row``; returns the non-finite count."""
    bad = 0
    if kind == 0:
        s16 = src16[off : off + n]
        for c in range(n):
            v = h2f(s16[c])
            row[c] = v
            bad += (v - v) != ZERO  # NaN for inf and NaN, 0 otherwise
    elif kind == 1:
        s16 = src16[off : off + n]
        for c in range(n):
            v = bf2f(s16[c])
            row[c] = v
            bad += (v - v) != ZERO
    else:
        s32 = src32[off : off + n]
        for c in range(n):
            v = s32[c]
            row[c] = v
            bad += (v - v) != ZERO
    return bad


@njit(nogil=True, cache=False, inline="always")
def _store_row(row: Any, dst16: Any, dst32: Any, kind: int, off: int, n: int) -> None:
    if kind == 0:
        d16 = dst16[off : off + n]
        for c in range(n):
            v = min(max(row[c], -FP16_MAX), FP16_MAX)  # saturate, as the reference does
            d16[c] = f2h(v)
    elif kind == 1:
        d16 = dst16[off : off + n]
        for c in range(n):
            d16[c] = f2bf(row[c])
    else:
        d32 = dst32[off : off + n]
        for c in range(n):
            d32[c] = row[c]


@njit(nogil=True, cache=False, inline="always")
def _stats(lo: Any, hi: Any, recip: Any) -> tuple[Any, Any]:
    """(min16, sc16) float16 bits: min rounded down, scale rounded up, -0 stored as +0."""
    m: Any = np.int64(f2h(lo))
    if h2f(np.uint16(m)) > lo:
        if m == 0:
            m = 0x8001
        elif m >= 0x8000:
            m += 1
        else:
            m -= 1
    if m == 0x8000:
        m = 0
    s32 = (hi - h2f(np.uint16(m))) * recip
    s: Any = np.int64(f2h(s32))
    if h2f(np.uint16(s)) < s32:
        s += 1
    if s == 0x8000:
        s = 0
    return m, s


@njit(nogil=True, cache=False, inline="always")
def _stats_run(
    lo: Any, hi: Any, n: int, recip: Any, mins: Any, scales: Any, mnf: Any, inv: Any
) -> int:
    """Statistics of ``n`` groups: float16 bits into ``mins``/``scales`` (payload slices), their
    float32 minimum into ``mnf`` and inverse scale into ``inv``; returns non-zero when a group
    reaches beyond float16's range (a maximum above 65504, or a non-finite min or scale: a
    minimum below -65504). One loop over all groups of a block or row (it vectorizes; ``mnf``
    may be ``lo``)."""
    bad = 0
    for i in range(n):
        m, s = _stats(lo[i], hi[i], recip)
        mins[i] = m
        scales[i] = s
        bad += _nonfinite16(m) + _nonfinite16(s) + (1 if hi[i] > FP16_MAX else 0)
        mnf[i] = h2f(np.uint16(m))
        sf = h2f(np.uint16(s))
        inv[i] = ONE / sf if sf > ZERO else ZERO
    return bad


@njit(nogil=True, cache=False, inline="always")
def _key(v: Any) -> Any:
    """A float32 as an integer with the same order (-0 just below +0): a float min/max
    reduction does not vectorize without fast-math, an integer one does."""
    b = np.int64(np.int32(f32_bits(v)))
    return b ^ ((b >> 31) & _LOW31)


@njit(nogil=True, cache=False, inline="always")
def _unkey(k: Any) -> Any:
    b = k ^ ((k >> 31) & _LOW31)
    return bits_f32(np.uint32(b & 0xFFFFFFFF))


@njit(nogil=True, cache=False, inline="always")
def _nonfinite16(bits: int) -> int:
    return 1 if (bits & 0x7C00) == 0x7C00 else 0


@njit(nogil=True, cache=False, inline="always")
def _pack(q: Any, codes: Any, off: int, rb: int, bits: int) -> None:
    """Pack a padded row of codes (``per_byte * rb`` entries) into ``rb`` bytes."""
    out = codes[off : off + rb]
    q0 = q[:rb]
    q1 = q[rb : 2 * rb]
    if bits == 2:
        q2 = q[2 * rb : 3 * rb]
        q3 = q[3 * rb : 4 * rb]
        for j in range(rb):
            out[j] = q0[j] | (q1[j] << 2) | (q2[j] << 4) | (q3[j] << 6)
    else:
        for j in range(rb):
            out[j] = q0[j] | (q1[j] << 4)


@njit(nogil=True, cache=False, inline="always")
def _quantize(row: Any, mn: Any, inv: Any, q: Any, n: int, levels: int) -> None:
    for c in range(n):
        y = (row[c] - mn[c]) * inv[c] + HALF  # >= 0.5: truncation is floor
        q[c] = min(np.int32(y), levels)


@njit(nogil=True, cache=False)
def encode_plane(
    src16: Any,
    src32: Any,
    kind: int,
    base: int,
    sl: int,
    st: int,
    tokens: int,
    channels: int,
    group: int,
    bits: int,
    recip: Any,
    per_channel: bool,
    block: int,
    mins: Any,
    scales: Any,
    codes: Any,
    start: int,
    end: int,
) -> int:
    """Quantize and pack units ``[start, end)`` of one plane; returns the non-finite count
    (NaN/inf input, or values beyond float16's range: the caller then stores raw).

    A unit is ``block`` tokens of one layer (``block == group`` for per-channel planes).
    Per-channel planes take two passes over the block (min/max, then quantize), per-token
    planes one; both share one row loader, one quantizer and one packer, which keeps the
    compiled code (and numba's compile time) small.
    """
    levels = (1 << bits) - 1
    per_byte = 8 // bits
    rb = (channels + per_byte - 1) // per_byte
    ngc = (channels + group - 1) // group
    nblk = (tokens + block - 1) // block
    passes = 2 if per_channel else 1
    row = np.empty(channels, np.float32)
    mn = np.empty(channels, np.float32)
    mx = np.empty(channels, np.float32)
    inv = np.empty(channels, np.float32)
    glo = np.empty(ngc, np.float32)
    ghi = np.empty(ngc, np.float32)
    ginv = np.empty(ngc, np.float32)
    q = np.zeros(per_byte * rb, np.uint8)  # the padding slots stay zero
    bad = 0
    for u in range(start, end):
        layer = u // nblk
        t0 = (u - layer * nblk) * block
        t1 = min(t0 + block, tokens)
        lbase = base + layer * sl
        for ps in range(passes):
            quantize = ps == passes - 1
            if per_channel and quantize:  # the block's per-channel statistics
                so = u * channels
                ms, ss = mins[so : so + channels], scales[so : so + channels]
                bad += _stats_run(mn, mx, channels, recip, ms, ss, mn, inv)
            for t in range(t0, t1):
                bad += _load_row(src16, src32, kind, lbase + t * st, channels, row)
                if not quantize:  # per-channel pass 1: min/max down the block
                    if t == t0:
                        mn[:] = row
                        mx[:] = row
                    else:
                        for c in range(channels):
                            v = row[c]
                            mn[c] = v if v < mn[c] else mn[c]
                            mx[c] = v if v > mx[c] else mx[c]
                    continue
                r = layer * tokens + t
                if not per_channel:  # per-token: the row's groups of channels
                    for gi in range(ngc):
                        seg = row[gi * group : min(gi * group + group, channels)]
                        lo = _key(seg[0])
                        hi = lo
                        for c in range(seg.size):  # integer min/max reductions vectorize
                            k = _key(seg[c])
                            lo = min(lo, k)
                            hi = max(hi, k)
                        glo[gi] = _unkey(lo)
                        ghi[gi] = _unkey(hi)
                    ms, ss = mins[r * ngc : r * ngc + ngc], scales[r * ngc : r * ngc + ngc]
                    bad += _stats_run(glo, ghi, ngc, recip, ms, ss, glo, ginv)
                    for gi in range(ngc):
                        c0 = gi * group
                        c1 = min(c0 + group, channels)
                        mn[c0:c1] = glo[gi]
                        inv[c0:c1] = ginv[gi]
                _quantize(row, mn, inv, q, channels, levels)
                _pack(q, codes, r * rb, rb, bits)
    return bad


@njit(nogil=True, cache=False, inline="always")
def _dequantize(
    codes: Any, off: int, rb: int, bits: int, channels: int, mn: Any, sc: Any, row: Any
) -> None:
    """Unpack a row of ``rb`` bytes and dequantize it into ``row`` (float32)."""
    mask = (1 << bits) - 1
    per_byte = 8 // bits
    packed = codes[off : off + rb]
    for s in range(per_byte):
        c0 = s * rb
        n = min(rb, channels - c0)
        shift = bits * s
        out = row[c0 : c0 + n]
        m = mn[c0 : c0 + n]
        k = sc[c0 : c0 + n]
        for j in range(n):
            code = np.float32((packed[j] >> shift) & mask)
            out[j] = code * k[j] + m[j]


@njit(nogil=True, cache=False)
def decode_plane(
    codes: Any,
    mins: Any,
    scales: Any,
    dst16: Any,
    dst32: Any,
    kind: int,
    base: int,
    sl: int,
    st: int,
    tokens: int,
    channels: int,
    group: int,
    bits: int,
    per_channel: bool,
    block: int,
    start: int,
    end: int,
) -> None:
    """Unpack, dequantize and store units ``[start, end)`` of one plane (units as in
    ``encode_plane``)."""
    per_byte = 8 // bits
    rb = (channels + per_byte - 1) // per_byte
    ngc = (channels + group - 1) // group
    nblk = (tokens + block - 1) // block
    row = np.empty(channels, np.float32)
    mn = np.empty(channels, np.float32)
    sc = np.empty(channels, np.float32)
    for u in range(start, end):
        layer = u // nblk
        t0 = (u - layer * nblk) * block
        t1 = min(t0 + block, tokens)
        if per_channel:
            for c in range(channels):
                mn[c] = h2f(mins[u * channels + c])
                sc[c] = h2f(scales[u * channels + c])
        for t in range(t0, t1):
            r = layer * tokens + t
            if not per_channel:
                for gi in range(ngc):
                    c0 = gi * group
                    c1 = min(c0 + group, channels)
                    mn[c0:c1] = h2f(mins[r * ngc + gi])
                    sc[c0:c1] = h2f(scales[r * ngc + gi])
            _dequantize(codes, r * rb, rb, bits, channels, mn, sc, row)
            _store_row(row, dst16, dst32, kind, base + layer * sl + t * st, channels)
