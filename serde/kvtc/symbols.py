"""How ``kvtc`` turns a quantized coefficient into rANS symbols, and its static tables.

A coefficient ``q`` (an integer: the coefficient divided by its plane's step, rounded) of a
coordinate whose calibration spread is ``w = std / step`` steps:

- wide coordinates (``w > WMAX``) are split: ``q = hi * 2**shift + lo``, where ``shift`` makes
  ``w / 2**shift`` at most ``WMAX``. ``lo`` (``shift`` bits) is nearly uniform at that scale
  and is stored as raw bits; only ``hi`` is entropy coded;
- the coded value's *class* ``k`` is its spread in half-octaves, ``round(2 log2 w') + OFFSET``
  (clamped to ``0..NCLS-1``); the class fixes a range ``-R_k..R_k`` of symbols the class's
  table covers (about ``RANGE_SPREADS`` spreads) and an escape symbol (index 0) for anything
  outside it, whose value is stored beside the streams;
- class and shift are properties of the coordinate, fixed by the calibration: nothing about
  them travels with a chunk.

Tables are one per (plane, class), static per model: counted on the calibration data, every
symbol of the range (and the escape) given at least a count of one so that any chunk can be
coded, and stored in the calibration as ``serde.cachegen.tables`` log-scale codes (one byte a
symbol). The coder is the project's static rANS (``gpu.reference.rans`` is the spec,
``gpu.cpu.rans`` the numba kernels), ``PREC`` = 12 bits of probability.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from serde.cachegen.tables import Tables, build, codes_of

WMAX = 8.0  # widest coded spread, in symbols
OFFSET = 8  # class of a spread of 1/16 of a step is 0
NCLS = 2 * int(math.log2(WMAX)) + OFFSET + 1  # 15: classes 0..14
RANGE_SPREADS = 5.0
MAX_SHIFT = 24


def class_width(k: int) -> float:
    return float(2.0 ** ((k - OFFSET) / 2))


def class_range(k: int) -> int:
    """``R_k``: the class's table codes ``-R_k..R_k`` (indices ``1..2 R_k + 1``), 0 escapes."""
    return math.ceil(RANGE_SPREADS * class_width(k)) + 1


RANGES = np.array([class_range(k) for k in range(NCLS)], np.int64)
ALPHABET = 2 * int(RANGES.max()) + 2  # symbol indices of the widest class (< 256)


def shifts_and_classes(spread: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], ...]:
    """``(shift, class)`` (uint8) of coordinates whose spread is ``spread`` steps."""
    w = np.maximum(spread.astype(np.float64), 1e-30)
    shift = np.clip(np.ceil(np.log2(w / WMAX)), 0, MAX_SHIFT)
    coded = w / np.exp2(shift)
    k = np.clip(np.round(2 * np.log2(coded)) + OFFSET, 0, NCLS - 1)
    return shift.astype(np.uint8), k.astype(np.uint8)


def table_id(plane: int, cls: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    out: np.ndarray[Any, Any] = plane * NCLS + cls.astype(np.int64)
    return out


def symbol_index(hi: Any, rng: Any) -> Any:
    """The table index of coded values ``hi`` with class ranges ``rng`` (0: escaped)."""
    inside = (hi >= -rng) & (hi <= rng)
    return np.where(inside, hi + rng + 1, 0)


def empty_counts(planes: int) -> np.ndarray[Any, Any]:
    return np.zeros((planes * NCLS, ALPHABET), np.int64)


def table_codes(counts: np.ndarray[Any, Any]) -> list[bytes]:
    """Per table id: the log-scale codes of its symbols ``0..2 R + 1``, every one present."""
    out = []
    for t in range(counts.shape[0]):
        n = 2 * int(RANGES[t % NCLS]) + 2
        out.append(codes_of(counts[t, :n] + 1).tobytes())
    return out


def tables_of(codes: list[bytes], planes: int) -> Tables:
    """The coder's tables from stored codes (validated by the caller: lengths, no zeros)."""
    arrays = [np.frombuffer(c, np.uint8).copy() for c in codes]
    ids = np.arange(len(arrays), dtype=np.int64)
    return build(ids, np.zeros(len(arrays), np.int64), arrays, planes)


def check_codes(codes: list[bytes], planes: int) -> str | None:
    """What is wrong with stored table codes, or None."""
    if len(codes) != planes * NCLS:
        return f"{len(codes)} tables, expected {planes * NCLS}"
    for t, c in enumerate(codes):
        if len(c) != 2 * int(RANGES[t % NCLS]) + 2 or 0 in c:
            return f"table {t} is malformed"
    return None
