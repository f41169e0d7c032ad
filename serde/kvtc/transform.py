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

import numpy as np

from serde.kvtc import rope as rope_ops
from serde.kvtc.rope import Rope

if TYPE_CHECKING:
    import torch

    from serde.kvtc.calibration import Device


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


def coefficients(x: torch.Tensor, dev: Device) -> torch.Tensor:
    """Coefficients of ``x`` ``[tokens, F]`` in steps (unrounded): ``[rank, tokens]``."""
    if x.device.type == "cpu":
        return _host_matmul(dev.encode, x.t(), dev.offset, -1.0)
    return torch_addmm(dev.offset, dev.encode, x.t())


def reconstruct(q: torch.Tensor, dev: Device) -> torch.Tensor:
    """``[tokens, F]`` float32 from ``[rank, tokens]`` float32 coefficients (in steps)."""
    if q.device.type == "cpu":
        return _host_matmul(q.t(), dev.decode, dev.mean, 1.0)
    return torch_addmm(dev.mean, q.t(), dev.decode, beta=1.0)


def torch_addmm(
    bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float = -1.0
) -> torch.Tensor:
    """``beta * bias + a @ b`` in one BLAS call (no extra pass over the result)."""
    import torch

    return torch.addmm(bias, a, b, beta=beta)


def _host_matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor, sign: float) -> torch.Tensor:
    """``a @ b + sign * bias`` with numpy's BLAS on the host. Why not torch there: torch's
    OpenMP threads spin between calls, and next to the codec's numba threads on two busy
    cores its small matrix products ran 5-25x slower than numpy's (measured: 7.7 ms vs
    1.2 ms for [256, 192] @ [192, 100])."""
    import torch

    out = np.matmul(a.numpy(), b.numpy())
    if sign < 0:
        out -= bias.numpy()
    else:
        out += bias.numpy()
    return torch.from_numpy(out)
