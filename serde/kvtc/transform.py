"""The transform both ``fit`` and the codec apply: which tokens are coded, layer groups as
feature vectors, RoPE undone on keys, and projection on a group's basis.

Tokens kept exact: the attention sinks (the first ``sinks`` positions of a sequence, which
every later query attends to heavily, so a small error there costs much more end to end than
the chunk-local error suggests) and optionally the last ``window`` tokens of the chunk. When
the chunk's start position is unknown its first ``sinks`` tokens are kept exact (it may be a
sequence's first chunk).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from serde.kvtc import rope as rope_ops
from serde.kvtc.rope import Rope

if TYPE_CHECKING:
    import torch


def exact_tokens(tokens: int, position: int | None, sinks: int, window: int) -> tuple[int, int]:
    """``(head, tail)``: how many leading and trailing tokens of a chunk are stored exactly."""
    start = 0 if position is None else position
    head = min(tokens, max(0, sinks - start))
    tail = min(tokens - head, max(0, window))
    return head, tail


def positions(first: int, count: int, device: torch.device) -> torch.Tensor:
    import torch

    return torch.arange(first, first + count, dtype=torch.int64, device=device)


def unrotated_keys(keys: torch.Tensor, rope: Rope, first: int) -> torch.Tensor:
    """``keys`` ``[layers, tokens, channels]`` float32 with RoPE undone (positions from
    ``first``)."""
    return rope_ops.undo(keys, rope, positions(first, keys.shape[1], keys.device))


def rotated_keys(keys: torch.Tensor, rope: Rope, first: int) -> torch.Tensor:
    return rope_ops.apply(keys, rope, positions(first, keys.shape[1], keys.device))


def group_features(plane: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """Layers ``first..first+count`` of ``plane`` ``[layers, tokens, channels]`` as feature
    vectors ``[tokens, count * channels]`` (layer after layer)."""
    part = plane[first : first + count]
    return part.permute(1, 0, 2).reshape(part.shape[1], -1)


def ungroup(features: torch.Tensor, count: int) -> torch.Tensor:
    """The inverse of ``group_features``: ``[count, tokens, channels]``."""
    tokens = features.shape[0]
    return features.reshape(tokens, count, -1).permute(1, 0, 2)


def quantize(x: torch.Tensor, mean: torch.Tensor, basis: torch.Tensor, step: float) -> torch.Tensor:
    """Coefficients of ``x`` ``[tokens, F]`` on ``basis`` ``[F, rank]`` in steps, rounded:
    ``[rank, tokens]`` int32 (component-major: one component's tokens are one stream run)."""
    y = (x - mean) @ (basis * (1.0 / step))
    return y.t().round().to(dtype=_int32())


def dequantize(
    q: torch.Tensor, mean: torch.Tensor, basis: torch.Tensor, step: float
) -> torch.Tensor:
    """``[tokens, F]`` float32 from ``[rank, tokens]`` coefficients."""
    return q.t().float() @ (basis.t() * step) + mean


def _int32() -> torch.dtype:
    import torch

    return torch.int32
