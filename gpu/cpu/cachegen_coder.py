"""numba rANS stream kernels of CacheGen (``gpu.cpu.cachegen`` calls them; the coder is
``gpu.reference.rans``'s, the stream layout ``gpu.reference.cachegen``'s).

The loops are branch-free (the renormalization and the context are arithmetic), code two
streams at once where both are full blocks (independent dependency chains keep the core busy)
and replace the encoder's division by a multiplication with an exact reciprocal
(``gpu.cpu.rans.encoder_entries``). The tables are indexed by table id directly (every
possible id has a row; unused rows are zero and flagged in ``used``), which keeps a load off
the decoder's dependency chain, and the decoder's lookup table gives the next symbol's context
with the symbol (``gpu.cpu.rans.context_lut``). All kernels are ``nogil`` and run over a range
of streams ``[s0, s1)``.

Helpers only ever take scalars or are called once per stream: numba passes arrays to a
non-inlined function with reference counting, which costs more than a whole rANS step.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from gpu.cpu.cachegen_kernels import index_row, store_block
from gpu.cpu.rans_words import MASK16, PRECU, RENORM, SLOT, TOTAL, W8, W16, W32, ZERO, L
from serde.cachegen.tables import CTX_START, NCLS, NCTX, NSYM, QMAX

NSYMU = np.uint64(NSYM)


@njit(nogil=True, cache=False)
def _encode_one(
    sym: Any, cls: Any, th: Any, ent: Any, block: Any, buf: Any, lengths: Any, s: Any
) -> None:
    layers, channels, tokens = sym.shape[1], sym.shape[2], sym.shape[3]
    nblocks = (channels + block - 1) // block
    pl, b = s // nblocks, s % nblocks
    p, lay = pl // layers, pl % layers
    out = buf[s]
    cap = out.shape[0]
    idx = np.zeros(tokens, np.int64)
    x = L
    pos = cap
    for c in range(min(channels, (b + 1) * block) - 1, b * block - 1, -1):
        k = cls[p, lay, c]
        index_row(sym[p, lay, c], (p * NCLS + k) * NCTX, th[k, 0], th[k, 1], idx)
        for t in range(tokens - 1, -1, -1):
            e = idx[t] * 4
            cm = np.uint64(ent[e + 3])
            out[pos - 1] = np.uint16(x & MASK16)
            o = x >= ((TOTAL - cm) << RENORM)
            pos -= np.int64(o)
            x >>= W16 * np.uint64(o)
            qq = (((x * np.uint64(ent[e])) >> W32) + x) >> np.uint64(ent[e + 1])
            x = x + np.uint64(ent[e + 2]) + qq * cm
    out[pos - 1] = np.uint16(x & MASK16)
    out[pos - 2] = np.uint16(x >> W16)
    lengths[s] = cap - pos + 2


@njit(nogil=True, cache=False)
def _encode_two(
    sym: Any, cls: Any, th: Any, ent: Any, block: Any, buf: Any, lengths: Any, s: Any
) -> None:
    """Streams ``s`` and ``s + 1`` (both full blocks), interleaved."""
    layers, tokens = sym.shape[1], sym.shape[3]
    nblocks = (sym.shape[2] + block - 1) // block
    pa, la, ba = (s // nblocks) // layers, (s // nblocks) % layers, s % nblocks
    s2 = s + 1
    pb, lb, bb = (s2 // nblocks) // layers, (s2 // nblocks) % layers, s2 % nblocks
    outa, outb = buf[s], buf[s2]
    cap = outa.shape[0]
    idxa = np.zeros(tokens, np.int64)
    idxb = np.zeros(tokens, np.int64)
    xa = L
    xb = L
    ia = cap
    ib = cap
    for j in range(block - 1, -1, -1):
        ca, cb = ba * block + j, bb * block + j
        ka, kb = cls[pa, la, ca], cls[pb, lb, cb]
        index_row(sym[pa, la, ca], (pa * NCLS + ka) * NCTX, th[ka, 0], th[ka, 1], idxa)
        index_row(sym[pb, lb, cb], (pb * NCLS + kb) * NCTX, th[kb, 0], th[kb, 1], idxb)
        for t in range(tokens - 1, -1, -1):
            ea, eb = idxa[t] * 4, idxb[t] * 4
            cma, cmb = np.uint64(ent[ea + 3]), np.uint64(ent[eb + 3])
            outa[ia - 1] = np.uint16(xa & MASK16)
            outb[ib - 1] = np.uint16(xb & MASK16)
            oa = xa >= ((TOTAL - cma) << RENORM)
            ob = xb >= ((TOTAL - cmb) << RENORM)
            ia -= np.int64(oa)
            ib -= np.int64(ob)
            xa >>= W16 * np.uint64(oa)
            xb >>= W16 * np.uint64(ob)
            qqa = (((xa * np.uint64(ent[ea])) >> W32) + xa) >> np.uint64(ent[ea + 1])
            qqb = (((xb * np.uint64(ent[eb])) >> W32) + xb) >> np.uint64(ent[eb + 1])
            xa = xa + np.uint64(ent[ea + 2]) + qqa * cma
            xb = xb + np.uint64(ent[eb + 2]) + qqb * cmb
    outa[ia - 1] = np.uint16(xa & MASK16)
    outa[ia - 2] = np.uint16(xa >> W16)
    outb[ib - 1] = np.uint16(xb & MASK16)
    outb[ib - 2] = np.uint16(xb >> W16)
    lengths[s] = cap - ia + 2
    lengths[s2] = cap - ib + 2


@njit(nogil=True, cache=False, inline="always")
def _full(s: Any, nblocks: Any, channels: Any, block: Any) -> Any:
    return (s % nblocks) * block + block <= channels


@njit(nogil=True, cache=False)
def encode_range(
    sym: Any, cls: Any, th: Any, ent: Any, block: Any, buf: Any, lengths: Any, s0: Any, s1: Any
) -> None:
    channels = sym.shape[2]
    nblocks = (channels + block - 1) // block
    s = s0
    while s < s1:
        if (
            s + 1 < s1
            and _full(s, nblocks, channels, block)
            and _full(s + 1, nblocks, channels, block)
        ):
            _encode_two(sym, cls, th, ent, block, buf, lengths, s)
            s += 2
        else:
            _encode_one(sym, cls, th, ent, block, buf, lengths, s)
            s += 1


@njit(nogil=True, cache=False)
def _decode_one(
    words: Any,
    offsets: Any,
    cls: Any,
    used: Any,
    dent: Any,
    lut: Any,
    block: Any,
    cval: Any,
    cstep: Any,
    tfac: Any,
    vals: Any,
    s: Any,
) -> Any:
    """Decode stream ``s`` into ``vals[:channels in the block]``; whether it was clean."""
    layers, channels = cls.shape[1], cls.shape[2]
    tokens = tfac.shape[2]
    nblocks = (channels + block - 1) // block
    pl, b = s // nblocks, s % nblocks
    p, lay = pl // layers, pl % layers
    pos, end = offsets[s], offsets[s + 1]
    good = end - pos >= 2
    last = max(end - 1, pos)
    x = (np.uint64(words[min(pos, last)]) << W16) | np.uint64(words[min(pos + 1, last)])
    pos += 2
    tf = tfac[p, lay]
    for c in range(b * block, min(channels, (b + 1) * block)):
        k = cls[p, lay, c]
        base = (p * NCLS + k) * NCTX
        cv, cs = cval[p, lay, c], cstep[p, lay, c]
        out = vals[c - b * block]
        d = base + CTX_START
        for t in range(tokens):
            good &= used[np.uint64(d)]
            slot = x & SLOT
            v = np.uint64(lut[(np.uint64(d) << PRECU) | slot])
            i = v & np.uint64(0xFF)
            e = np.uint64(dent[np.uint64(d) * NSYMU + i])
            x = (e & MASK16) * (x >> PRECU) + slot - (e >> W16)
            need = np.uint64(x < L)  # branch-free: the renormalization is unpredictable
            good &= (need == 0) | (pos < end)
            w = np.uint64(words[np.uint64(min(pos, last))])
            x = (x << (W16 * need)) | (w & (ZERO - need))
            pos += np.int64(need)
            out[t] = cv + np.float32(np.int64(i) - QMAX) * (cs * tf[t])
            d = base + np.int64(v >> W8)
    return good and x == L and pos == end


@njit(nogil=True, cache=False)
def _decode_two(
    words: Any,
    offsets: Any,
    cls: Any,
    used: Any,
    dent: Any,
    lut: Any,
    block: Any,
    cval: Any,
    cstep: Any,
    tfac: Any,
    vala: Any,
    valb: Any,
    s: Any,
) -> Any:
    """Streams ``s`` and ``s + 1`` (both full blocks), interleaved; whether both were clean."""
    layers, channels = cls.shape[1], cls.shape[2]
    tokens = tfac.shape[2]
    nblocks = (channels + block - 1) // block
    s2 = s + 1
    pa, la, ba = (s // nblocks) // layers, (s // nblocks) % layers, s % nblocks
    pb, lb, bb = (s2 // nblocks) // layers, (s2 // nblocks) % layers, s2 % nblocks
    ia, enda = offsets[s], offsets[s + 1]
    ib, endb = offsets[s2], offsets[s2 + 1]
    good = enda - ia >= 2 and endb - ib >= 2
    lasta, lastb = max(enda - 1, ia), max(endb - 1, ib)
    xa = (np.uint64(words[min(ia, lasta)]) << W16) | np.uint64(words[min(ia + 1, lasta)])
    xb = (np.uint64(words[min(ib, lastb)]) << W16) | np.uint64(words[min(ib + 1, lastb)])
    ia += 2
    ib += 2
    tfa, tfb = tfac[pa, la], tfac[pb, lb]
    for j in range(block):
        ca, cb = ba * block + j, bb * block + j
        ka, kb = cls[pa, la, ca], cls[pb, lb, cb]
        basea, baseb = (pa * NCLS + ka) * NCTX, (pb * NCLS + kb) * NCTX
        cva, csa, cvb, csb = (
            cval[pa, la, ca],
            cstep[pa, la, ca],
            cval[pb, lb, cb],
            cstep[pb, lb, cb],
        )
        outa, outb = vala[j], valb[j]
        da, db = basea + CTX_START, baseb + CTX_START
        for t in range(tokens):
            good &= used[np.uint64(da)] & used[np.uint64(db)]
            slota, slotb = xa & SLOT, xb & SLOT
            va = np.uint64(lut[(np.uint64(da) << PRECU) | slota])
            vb = np.uint64(lut[(np.uint64(db) << PRECU) | slotb])
            sa, sb = va & np.uint64(0xFF), vb & np.uint64(0xFF)
            ea = np.uint64(dent[np.uint64(da) * NSYMU + sa])
            eb = np.uint64(dent[np.uint64(db) * NSYMU + sb])
            xa = (ea & MASK16) * (xa >> PRECU) + slota - (ea >> W16)
            xb = (eb & MASK16) * (xb >> PRECU) + slotb - (eb >> W16)
            needa, needb = np.uint64(xa < L), np.uint64(xb < L)
            good &= ((needa == 0) | (ia < enda)) & ((needb == 0) | (ib < endb))
            wa, wb = (
                np.uint64(words[np.uint64(min(ia, lasta))]),
                np.uint64(words[np.uint64(min(ib, lastb))]),
            )
            xa = (xa << (W16 * needa)) | (wa & (ZERO - needa))
            xb = (xb << (W16 * needb)) | (wb & (ZERO - needb))
            ia += np.int64(needa)
            ib += np.int64(needb)
            outa[t] = cva + np.float32(np.int64(sa) - QMAX) * (csa * tfa[t])
            outb[t] = cvb + np.float32(np.int64(sb) - QMAX) * (csb * tfb[t])
            da, db = basea + np.int64(va >> W8), baseb + np.int64(vb >> W8)
    return good and xa == L and xb == L and ia == enda and ib == endb


@njit(nogil=True, cache=False)
def decode_range(
    words: Any,
    offsets: Any,
    cls: Any,
    used: Any,
    dent: Any,
    lut: Any,
    block: Any,
    cval: Any,
    cstep: Any,
    tfac: Any,
    bits: Any,
    floats: Any,
    kind: Any,
    off: Any,
    sp: Any,
    sl: Any,
    st: Any,
    sc: Any,
    limit: Any,
    ok: Any,
    s0: Any,
    s1: Any,
) -> None:
    """Streams into float32 scratch blocks, then stored row by row in the stored dtype."""
    layers, channels = cls.shape[1], cls.shape[2]
    tokens = tfac.shape[2]
    nblocks = (channels + block - 1) // block
    vals = np.zeros((2, block, tokens), np.float32)
    s = s0
    while s < s1:
        two = (
            s + 1 < s1
            and _full(s, nblocks, channels, block)
            and _full(s + 1, nblocks, channels, block)
        )
        if two:
            both = _decode_two(
                words,
                offsets,
                cls,
                used,
                dent,
                lut,
                block,
                cval,
                cstep,
                tfac,
                vals[0],
                vals[1],
                s,
            )
            ok[s] = both
            ok[s + 1] = both
        else:
            ok[s] = _decode_one(
                words, offsets, cls, used, dent, lut, block, cval, cstep, tfac, vals[0], s
            )
        for i in range(2 if two else 1):
            pl, b = (s + i) // nblocks, (s + i) % nblocks
            p, lay = pl // layers, pl % layers
            n = min(channels, (b + 1) * block) - b * block
            store_block(
                vals[i, :n],
                bits,
                floats,
                kind,
                off + p * sp + lay * sl + b * block * sc,
                st,
                sc,
                limit,
            )
        s += 2 if two else 1
