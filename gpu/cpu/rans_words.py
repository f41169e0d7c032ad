"""The 32-bit rANS coder's constants as numba sees them (uint64, so no kernel mixes signed
and unsigned arithmetic): 16-bit renormalisation words, ``PREC``-bit frequency tables."""

from __future__ import annotations

import numpy as np

from serde.cachegen.tables import PREC

L = np.uint64(1 << 16)  # the state's lower bound: renormalise below it
W16 = np.uint64(16)
W32 = np.uint64(32)
MASK16 = np.uint64(0xFFFF)
SLOT = np.uint64((1 << PREC) - 1)
PRECU = np.uint64(PREC)
RENORM = np.uint64(32 - PREC)
TOTAL = np.uint64(1 << PREC)
ZERO = np.uint64(0)
W8 = np.uint64(8)
