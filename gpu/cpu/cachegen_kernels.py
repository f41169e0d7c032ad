"""numba element kernels of CacheGen: statistics, quantization, histograms, and reading and
writing the stored dtype (``gpu.cpu.cachegen`` calls them; ``gpu.reference.cachegen`` is the
spec; the stream coder is ``gpu.cpu.cachegen_coder``). Each runs over a range of units
``[u0, u1)`` (a (plane, layer)) so that ``gpu.dispatch`` can split a call over the cores; all
are ``nogil``.

Inputs and outputs in the stored dtype are addressed as ``(bits, floats, kind, offset, sp, sl,
st, sc)``: flat uint16 bits (float16 / bfloat16) or float32 storage, and element strides of
the model view ``[planes, layers, tokens, channels]`` (``gpu.cpu.cachegen_source``).

Helpers that take arrays are called once per row, never per element: numba passes arrays to
a function with reference counting, which costs more than the work on one element.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from gpu.cpu.half import bf2f, f2bf, f2h, h2f
from serde.cachegen.tables import CTX_START, NCLS, NCTX, NSYM, QMAX


@njit(nogil=True, cache=False)
def load_row(bits: Any, floats: Any, kind: Any, start: Any, stride: Any, row: Any) -> None:
    """``row[c] = x[start + c * stride]`` as float32 (one call per row: array arguments cost
    reference counting per call, so no helper is called per element)."""
    n = row.shape[0]
    if stride == 1:  # contiguous channels: a loop LLVM vectorizes
        if kind == 1:
            src16 = bits[start : start + n]
            for c in range(n):
                row[c] = h2f(src16[c])
        elif kind == 2:
            src16 = bits[start : start + n]
            for c in range(n):
                row[c] = bf2f(src16[c])
        else:
            row[:] = floats[start : start + n]
    elif kind == 1:
        for c in range(n):
            row[c] = h2f(bits[start + c * stride])
    elif kind == 2:
        for c in range(n):
            row[c] = bf2f(bits[start + c * stride])
    else:
        for c in range(n):
            row[c] = floats[start + c * stride]


@njit(nogil=True, cache=False)
def store_block(
    vals: Any, bits: Any, floats: Any, kind: Any, start: Any, st: Any, sc: Any, limit: Any
) -> None:
    """``x[start + t * st + c * sc] = vals[c, t]`` in the stored dtype, saturated at ``limit``."""
    n, tokens = vals.shape
    for t in range(tokens):
        row = start + t * st
        if kind == 1:
            for c in range(n):
                bits[row + c * sc] = f2h(min(max(vals[c, t], -limit), limit))
        elif kind == 2:
            for c in range(n):
                bits[row + c * sc] = f2bf(min(max(vals[c, t], -limit), limit))
        else:
            for c in range(n):
                floats[row + c * sc] = min(max(vals[c, t], -limit), limit)


@njit(nogil=True, cache=False, inline="always")
def context(prev: Any, th1: Any, th2: Any) -> Any:
    """Branch-free ``serde.cachegen.tables.context_of``."""
    a = abs(prev)
    m = np.int64(a > th1) + np.int64(a > th2)
    return CTX_START + (np.int64(prev > 0) - np.int64(prev < 0)) * m


# fastmath: the float64 sums may be reordered (vectorized); statistics only need to agree with
# the reference to ~1e-13 (``serde.cachegen.model``), and nothing else here is fast-math.
@njit(nogil=True, cache=False, fastmath=True)
def stats_range(
    bits: Any,
    floats: Any,
    kind: Any,
    off: Any,
    sp: Any,
    sl: Any,
    st: Any,
    sc: Any,
    limit: Any,
    mean: Any,
    var: Any,
    tms: Any,
    u0: Any,
    u1: Any,
) -> None:
    layers, channels = mean.shape[1], mean.shape[2]
    tokens = tms.shape[2]
    acc = np.zeros(channels, np.float64)
    m = np.zeros(channels, np.float64)
    row = np.zeros(channels, np.float32)
    for u in range(u0, u1):
        p, lay = u // layers, u % layers
        base = off + p * sp + lay * sl
        acc[:] = 0.0
        for t in range(tokens):
            load_row(bits, floats, kind, base + t * st, sc, row)
            for c in range(channels):
                acc[c] += row[c]
        for c in range(channels):
            m[c] = acc[c] / tokens
            mean[p, lay, c] = m[c]
        acc[:] = 0.0
        for t in range(tokens):
            load_row(bits, floats, kind, base + t * st, sc, row)
            for c in range(channels):
                d = np.float64(row[c]) - m[c]
                acc[c] += d * d
        for c in range(channels):
            var[p, lay, c] = acc[c] / tokens
            acc[c] = 1.0 / var[p, lay, c] if var[p, lay, c] > 0 else 0.0
        for t in range(tokens):
            load_row(bits, floats, kind, base + t * st, sc, row)
            total = 0.0
            for c in range(channels):
                d = np.float64(row[c]) - m[c]
                total += d * d * acc[c]
            tms[p, lay, t] = total / channels


TILE = 32  # tokens quantized into a row-major tile, then written channel-major


@njit(nogil=True, cache=False)
def quantize_range(
    bits: Any,
    floats: Any,
    kind: Any,
    off: Any,
    sp: Any,
    sl: Any,
    st: Any,
    sc: Any,
    limit: Any,
    cval: Any,
    icstep: Any,
    itfac: Any,
    sym: Any,
    maxu: Any,
    sumsq: Any,
    u0: Any,
    u1: Any,
) -> None:
    layers, channels, tokens = sym.shape[1], sym.shape[2], sym.shape[3]
    lim = np.float32(QMAX)
    mx = np.zeros(channels, np.float32)
    sq = np.zeros(channels, np.int64)
    row = np.zeros(channels, np.float32)
    tile = np.zeros((TILE, channels), np.int8)
    for u in range(u0, u1):
        p, lay = u // layers, u % layers
        base = off + p * sp + lay * sl
        cv, ic = cval[p, lay], icstep[p, lay]
        mx[:] = 0
        sq[:] = 0
        for t0 in range(0, tokens, TILE):
            n = min(TILE, tokens - t0)
            for tt in range(n):
                load_row(bits, floats, kind, base + (t0 + tt) * st, sc, row)
                it = itfac[p, lay, t0 + tt]
                trow = tile[tt]
                for c in range(channels):
                    v = ((row[c] - cv[c]) * ic[c]) * it
                    mx[c] = max(mx[c], abs(v))
                    qi = np.int64(min(max(np.rint(v), -lim), lim))
                    trow[c] = qi
                    sq[c] += qi * qi
            for c in range(channels):
                out = sym[p, lay, c]
                for tt in range(n):
                    out[t0 + tt] = tile[tt, c]
        maxu[p, lay, :] = mx
        sumsq[p, lay, :] = sq


@njit(nogil=True, cache=False, inline="always")
def index_row(row: Any, base: Any, th1: Any, th2: Any, idx: Any) -> None:
    """``idx[t]`` = table id * NSYM + symbol index of every token of a channel (the context
    from the previous token): a loop without a carried dependency, so it vectorizes."""
    idx[0] = (base + CTX_START) * NSYM + np.int64(row[0]) + QMAX
    for t in range(1, row.shape[0]):
        idx[t] = (base + context(np.int64(row[t - 1]), th1, th2)) * NSYM + np.int64(row[t]) + QMAX


@njit(nogil=True, cache=False)
def histogram_range(sym: Any, cls: Any, th: Any, counts: Any, u0: Any, u1: Any) -> None:
    """Counts into ``counts[4, ids * NSYM]``: four interleaved histograms, so that increments
    of one bin do not wait on each other's store."""
    layers, channels, tokens = sym.shape[1], sym.shape[2], sym.shape[3]
    idx = np.zeros(tokens, np.int64)
    for u in range(u0, u1):
        p, lay = u // layers, u % layers
        for c in range(channels):
            k = cls[p, lay, c]
            index_row(sym[p, lay, c], (p * NCLS + k) * NCTX, th[k, 0], th[k, 1], idx)
            for t in range(0, tokens - 3, 4):
                counts[0, idx[t]] += 1
                counts[1, idx[t + 1]] += 1
                counts[2, idx[t + 2]] += 1
                counts[3, idx[t + 3]] += 1
            for t in range(tokens - tokens % 4, tokens):
                counts[0, idx[t]] += 1
