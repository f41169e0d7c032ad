"""Synthetic K/V with a real decoder's structure, for ``kvtc`` tests: low-rank across layers
and channels, smooth along tokens, keys rotated by RoPE at their positions."""

from __future__ import annotations

import torch

from serde.kvtc import rope as rope_ops
from serde.kvtc.fit import Chunk
from serde.kvtc.rope import Rope

ROPE = Rope(head_dim=32, theta=10000.0)
LAYERS, HEADS, RANK = 4, 2, 12
CHANNELS = HEADS * ROPE.head_dim


def correlated_kv(
    tokens: int, position: int, seed: int, dtype: torch.dtype = torch.float16
) -> torch.Tensor:
    """``[2, LAYERS, tokens, CHANNELS]``: one model (fixed mixing), data from ``seed``."""
    model = torch.Generator().manual_seed(1234)
    mix = torch.randn(2, RANK, LAYERS * CHANNELS, generator=model) / RANK**0.5
    offset = torch.randn(2, 1, LAYERS * CHANNELS, generator=model) * 0.5
    g = torch.Generator().manual_seed(seed)
    latent = torch.randn(2, tokens, RANK, generator=g)
    for t in range(1, tokens):  # smooth along tokens
        latent[:, t] = 0.8 * latent[:, t - 1] + 0.6 * latent[:, t]
    noise = torch.randn(2, tokens, LAYERS * CHANNELS, generator=g) * 0.03
    flat = latent @ mix + offset + noise  # [2, tokens, LAYERS * CHANNELS]
    kv = flat.reshape(2, tokens, LAYERS, CHANNELS).permute(0, 2, 1, 3).contiguous()
    pos = torch.arange(position, position + tokens)
    kv[0] = rope_ops.apply(kv[0], ROPE, pos)
    return kv.to(dtype)


def calibration_chunks(count: int = 6, tokens: int = 128) -> list[Chunk]:
    return [
        Chunk(correlated_kv(tokens, i * tokens, seed=100 + i), i * tokens) for i in range(count)
    ]
