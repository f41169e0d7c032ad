"""The symbol distributions of ``cachegen``: contexts, compact tables, rANS frequencies.

A symbol is a quantized value ``q`` in ``-QMAX..QMAX``, coded as the index ``q + QMAX`` in
``0..NSYM-1``. Every symbol is coded with the table of its *class* and *context*:

- the class (``0..NCLS-1``) belongs to a (plane, layer, channel) and says how wide that
  channel's symbols are: ``round(log2(mean(q**2))) + 4``, clamped (a half-octave of spread);
- the context (``0..NCTX-1``) is the bucket of the previous token's symbol in the same channel
  (``CTX_START`` for the first token): below ``-th2``, below ``-th1``, within ``th1``, above
  ``th1``, above ``th2``, with thresholds of half and one and a half typical widths of the class.
  Consecutive tokens are correlated (keys strongly), so this captures most of what delta coding
  would, without a prediction loop.

One table per (plane, class, context), shared by all layers (measured: per-layer tables cost
more in table bytes than they save). A table is stored compactly: its first used symbol, the
number of entries, and one byte per entry, ``0`` for an absent symbol, else ``1..255`` a count
on a log scale (a sixteenth of an octave below the table's largest count, whose code is 255).
Those codes are all the decoder gets, so the frequencies the coder uses are derived from them
by the integer-only ``frequencies`` on both sides: every present symbol gets at least 1 of
``2**PREC``, absent symbols 0 (they cost nothing). The log-scale rounding costs about 0.002
bits per symbol; a table costs 4 + entries bytes, a few kB per object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

QMAX = 127
NSYM = 2 * QMAX + 1
PREC = 12  # rANS frequencies sum to 2**PREC
TOTAL = 1 << PREC
NCLS = 32
NCTX = 5
CTX_START = NCTX // 2
CLASS_OFFSET = 4
CODE_STEPS = 16  # log-count codes per octave
CODE_MAX = 255

# Integer weight of each code: round(2 ** (code / 16)); codes of present symbols are >= 1.
WEIGHTS = np.array([round(2.0 ** (k / CODE_STEPS)) for k in range(CODE_MAX + 1)], np.int64)


def class_thresholds() -> np.ndarray[Any, Any]:
    """``[NCLS, 2]`` int32: ``(th1, th2)`` of each class (half and 1.5 typical widths)."""
    out = np.zeros((NCLS, 2), np.int32)
    for k in range(NCLS):
        width = 2.0 ** ((k - CLASS_OFFSET) / 2)
        out[k] = (int(np.floor(0.5 * width)), int(np.floor(1.5 * width)))
    return out


THRESHOLDS = class_thresholds()


def classes_from_sumsq(sumsq: np.ndarray[Any, Any], tokens: int) -> np.ndarray[Any, Any]:
    """The class (uint8) of each channel from the exact sum of its symbols' squares."""
    ms = sumsq.astype(np.float64) / max(tokens, 1)
    with np.errstate(divide="ignore"):
        k = np.floor(np.log2(np.where(ms > 0, ms, 1.0)) + 0.5) + CLASS_OFFSET
    k = np.where(ms > 0, k, 0)
    out: np.ndarray[Any, Any] = np.clip(k, 0, NCLS - 1).astype(np.uint8)
    return out


def context_of(prev: Any, th1: Any, th2: Any) -> Any:
    """The context of a symbol whose predecessor is ``prev`` (works on ints and arrays)."""
    a = abs(prev)
    m = (a > th1) * 1 + (a > th2) * 1
    return CTX_START + np.sign(prev) * m


@dataclass(frozen=True, slots=True)
class Tables:
    """The coder's view of the stored tables (dense: only the tables in use)."""

    ids: np.ndarray[Any, Any]  # [n] table id ((plane * NCLS + class) * NCTX + context)
    lo: np.ndarray[Any, Any]  # [n] first stored symbol index
    codes: list[np.ndarray[Any, Any]]  # per table: uint8 codes of symbols lo..lo+len-1
    tmap: np.ndarray[Any, Any]  # [planes * NCLS * NCTX] int32 dense index, -1 if unused
    freq: np.ndarray[Any, Any]  # [n, NSYM] int32
    cum: np.ndarray[Any, Any]  # [n, NSYM] int32 (start of each symbol's slot range)

    def lut(self) -> np.ndarray[Any, Any]:
        """``[n, TOTAL]`` uint8: the symbol index of every slot (for decoding)."""
        out = np.zeros((len(self.ids), TOTAL), np.uint8)
        idx = np.arange(NSYM, dtype=np.uint8)
        for d in range(len(self.ids)):
            out[d] = np.repeat(idx, self.freq[d])
        return out

    def nbytes(self) -> int:
        return 2 + sum(4 + len(c) for c in self.codes)


def frequencies(codes: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Integer frequencies summing to ``TOTAL`` from codes (0 = absent); integer-only."""
    present = codes > 0
    n = int(present.sum())
    w = np.where(present, WEIGHTS[codes], 0)
    spare = TOTAL - n
    freq = present.astype(np.int64) + (w * spare) // int(w.sum())
    freq[int(np.argmax(w))] += TOTAL - int(freq.sum())  # the rounding leftover (< n)
    out: np.ndarray[Any, Any] = freq
    return out


def codes_of(counts: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Log-scale codes of one table's counts (0 where the count is 0)."""
    top = float(counts.max())
    with np.errstate(divide="ignore"):
        c = np.floor(CODE_STEPS * np.log2(np.maximum(counts, 1) / top) + 0.5) + CODE_MAX
    return np.where(counts > 0, np.clip(c, 1, CODE_MAX), 0).astype(np.uint8)


def build(
    ids: np.ndarray[Any, Any], lo: np.ndarray[Any, Any], codes: list[Any], planes: int
) -> Tables:
    n = len(ids)
    freq = np.zeros((n, NSYM), np.int64)
    for d in range(n):
        freq[d, lo[d] : lo[d] + len(codes[d])] = frequencies(codes[d])
    cum = np.zeros((n, NSYM), np.int64)
    cum[:, 1:] = np.cumsum(freq, axis=1)[:, :-1]
    tmap = np.full(planes * NCLS * NCTX, -1, np.int32)
    tmap[ids] = np.arange(n, dtype=np.int32)
    return Tables(
        ids.astype(np.int64),
        lo.astype(np.int64),
        codes,
        tmap,
        freq.astype(np.int32),
        cum.astype(np.int32),
    )


def from_counts(counts: np.ndarray[Any, Any], planes: int) -> Tables:
    """The tables of a histogram ``[planes * NCLS * NCTX, NSYM]`` (the encoder's side)."""
    used = np.flatnonzero(counts.sum(axis=1) > 0)
    los, codes = [], []
    for t in used:
        nz = np.flatnonzero(counts[t])
        lo, hi = int(nz[0]), int(nz[-1]) + 1
        los.append(lo)
        codes.append(codes_of(counts[t, lo:hi]))
    return build(used, np.array(los, np.int64), codes, planes)


def ideal_bits(counts: np.ndarray[Any, Any], tables: Tables) -> float:
    """The bits rANS spends on ``counts`` with ``tables`` (before stream overheads)."""
    total = 0.0
    for d, t in enumerate(tables.ids):
        c = counts[t]
        nz = c > 0
        total -= float((c[nz] * np.log2(tables.freq[d][nz] / TOTAL)).sum())
    return total


def serialize(tables: Tables) -> bytes:
    """``u16 count``, then per table ``u16 id, u8 lo, u8 entries-1, u8 codes[entries]``."""
    out = bytearray(np.uint16(len(tables.ids)).tobytes())
    for t, lo, codes in zip(tables.ids, tables.lo, tables.codes, strict=True):
        out += np.array([t], "<u2").tobytes() + bytes((int(lo), len(codes) - 1)) + codes.tobytes()
    return bytes(out)


class TableError(ValueError):
    """Stored tables that no encoder writes."""


def deserialize(data: memoryview, planes: int) -> Tables:
    """Parse and validate ``serialize``'s bytes (all of them); ``TableError`` if malformed."""
    buf = bytes(data)
    if len(buf) < 2:
        raise TableError("tables truncated")
    n = int.from_bytes(buf[:2], "little")
    limit = planes * NCLS * NCTX
    if n > limit:
        raise TableError(f"{n} tables, at most {limit}")
    pos = 2
    ids: list[int] = []
    los: list[int] = []
    codes: list[np.ndarray[Any, Any]] = []
    for _ in range(n):
        if pos + 4 > len(buf):
            raise TableError("tables truncated")
        t = int.from_bytes(buf[pos : pos + 2], "little")
        lo, entries = buf[pos + 2], buf[pos + 3] + 1
        pos += 4
        if t >= limit or (ids and t <= ids[-1]) or lo + entries > NSYM or pos + entries > len(buf):
            raise TableError("malformed table header")
        c = np.frombuffer(buf, np.uint8, entries, pos).copy()
        pos += entries
        if c[0] == 0 or c[-1] == 0:
            raise TableError("a table must start and end with a present symbol")
        ids.append(t)
        los.append(lo)
        codes.append(c)
    if pos != len(buf):
        raise TableError("trailing bytes after the tables")
    return build(np.array(ids, np.int64), np.array(los, np.int64), codes, planes)
