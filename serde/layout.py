"""Which axis of a stored tensor is K/V, layer, token and channel.

Lossy codecs quantize keys per channel and values per token, so they must know the axes. The
frame records LMCache's memory format (``fmt``) and the shape; ``layout_of`` turns them into a
canonical 4-D view ``[planes, layers, tokens, channels]``:

=============  ======================  =====================================
format         stored shape            canonical view
=============  ======================  =====================================
KV_2LTD (1)    ``[2, L, T, D]``        ``[2, L, T, D]`` (the default chunk layout)
KV_T2D (2)     ``[T, 2, D]``           ``[2, 1, T, D]``
KV_2TD (3)     ``[2, T, D]``           ``[2, 1, T, D]``
KV_MLA_FMT (6) ``[1, L, T, D]``        ``[1, L, T, D]`` (one latent plane)
anything else  ``[..., D]``            ``[1, 1, prod(...), D]`` (generic rows x channels)
=============  ======================  =====================================

Plane 0 holds keys and plane 1 values; a one-plane layout is treated as keys. A declared format
whose shape does not fit it falls back to the generic layout, so every tensor can be encoded,
and decoding recomputes the same layout from the frame: nothing else travels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.types import MemoryFormat

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class KVLayout:
    planes: int
    layers: int
    tokens: int
    channels: int
    fmt: int  # the memory format this layout was derived from (UNDEFINED when generic)
    shape: tuple[int, ...]  # the stored shape

    @property
    def canonical_shape(self) -> tuple[int, int, int, int]:
        return (self.planes, self.layers, self.tokens, self.channels)

    @property
    def numel(self) -> int:
        return self.planes * self.layers * self.tokens * self.channels

    def to_canonical(self, t: torch.Tensor) -> torch.Tensor:
        """A view of ``t`` (stored shape) as ``[planes, layers, tokens, channels]``.

        Not necessarily contiguous (KV_T2D needs a permute); callers copy when they need to.
        """
        if self.fmt == MemoryFormat.KV_T2D:
            return t.permute(1, 0, 2).unsqueeze(1)
        return t.reshape(self.canonical_shape)

    def from_canonical(self, c: torch.Tensor) -> torch.Tensor:
        """The stored-shape tensor for a canonical one (contiguous)."""
        if self.fmt == MemoryFormat.KV_T2D:
            return c.squeeze(1).permute(1, 0, 2).contiguous()
        return c.reshape(self.shape).contiguous()


def layout_of(fmt: int, shape: tuple[int, ...] | list[int]) -> KVLayout:
    """The canonical layout of a tensor of ``shape`` stored in memory format ``fmt``."""
    s = tuple(int(d) for d in shape)
    if fmt == MemoryFormat.KV_2LTD and len(s) == 4 and s[0] == 2:
        return KVLayout(2, s[1], s[2], s[3], fmt, s)
    if fmt == MemoryFormat.KV_T2D and len(s) == 3 and s[1] == 2:
        return KVLayout(2, 1, s[0], s[2], fmt, s)
    if fmt == MemoryFormat.KV_2TD and len(s) == 3 and s[0] == 2:
        return KVLayout(2, 1, s[1], s[2], fmt, s)
    if fmt == MemoryFormat.KV_MLA_FMT and len(s) == 4 and s[0] == 1:
        return KVLayout(1, s[1], s[2], s[3], fmt, s)
    channels = s[-1] if s else 1
    rows = math.prod(s[:-1]) if len(s) > 1 else 1
    return KVLayout(1, 1, rows, channels, MemoryFormat.UNDEFINED, s)
