"""A strided float tensor as numba kernels see it: flat storage, element strides, dtype kind.

The CacheGen CPU kernels read the chunk where it lies and write decoded values where they
belong: a ``Source`` is the flat storage under a torch view (float16 and bfloat16 as ``uint16``
bits, float32 as is), the view's offset and element strides in model order
``[planes, layers, tokens, channels]``, and its dtype kind. Views of any layout work, so
KV_T2D is read and written without a transposing copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from serde.cachegen.model import FINITE_MAX

KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
LIMIT = {KIND[getattr(torch, name)]: v for name, v in FINITE_MAX.items()}
_EMPTY16 = np.empty(0, np.uint16)
_EMPTY32 = np.empty(0, np.float32)


@dataclass(frozen=True, slots=True)
class Source:
    bits: np.ndarray[Any, Any]  # uint16 storage (float16 / bfloat16), else empty
    floats: np.ndarray[Any, Any]  # float32 storage, else empty
    kind: int
    offset: int
    strides: tuple[int, int, int, int]
    shape: tuple[int, int, int, int]

    @staticmethod
    def of(t: torch.Tensor) -> Source:
        return source_of(t)

    def kernel_args(self) -> tuple[Any, ...]:
        """``(bits, floats, kind, offset, sp, sl, st, sc, limit)`` plus the shape checks."""
        return (
            self.bits,
            self.floats,
            self.kind,
            self.offset,
            *self.strides,
            np.float32(LIMIT[self.kind]),
        )


def source_of(t: torch.Tensor) -> Source:
    """The ``Source`` of a 4-D host view (its storage is shared, not copied)."""
    if t.dtype not in KIND or t.dim() != 4 or t.device.type != "cpu":
        raise ValueError(f"need a 4-D float host view, got {t.dtype} {tuple(t.shape)}")
    size = t.untyped_storage().nbytes() // t.element_size()
    flat = t.as_strided((size,), (1,), 0)
    kind = KIND[t.dtype]
    if kind == 0:
        bits, floats = _EMPTY16, flat.numpy()
    else:
        bits, floats = flat.view(torch.int16).numpy().view(np.uint16), _EMPTY32
    strides = tuple(int(s) for s in t.stride())
    shape = tuple(int(s) for s in t.shape)
    return Source(bits, floats, kind, int(t.storage_offset()), strides, shape)  # type: ignore[arg-type]
