"""Undo and redo rotary position embeddings (RoPE) on keys, Llama's rotate-half convention.

A key head of dimension ``h`` is rotated pairwise: element ``i`` and ``i + h/2`` (``i <
h/2``) by the angle ``position * theta ** (-2 i / h)``. Keys at different positions of the
same content differ only by these rotations, so undoing them before a PCA makes the keys of a
layer far more compressible (``docs``: REFERENCE §5, 5.6-6.2x instead of 4.8-5.1x at KIVI-4's
error). Rotations are orthogonal: redo(undo(k)) is k up to float32 rounding, and the
quantization error is not amplified.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class Rope:
    head_dim: int  # even
    theta: float  # the base (10000 for Llama 2, 100000 for SmolLM2)

    def angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of shape ``[tokens, head_dim / 2]`` (float32, on positions' device)."""
        import torch

        half = self.head_dim // 2
        exponent = torch.arange(half, dtype=torch.float64, device=positions.device) / half
        inv_freq = self.theta ** (-exponent)
        ang = positions.to(torch.float64)[:, None] * inv_freq[None, :]
        return torch.cos(ang).float(), torch.sin(ang).float()


def _rotate(k: torch.Tensor, rope: Rope, positions: torch.Tensor, sign: float) -> torch.Tensor:
    """``k`` ``[..., tokens, heads * head_dim]`` (float32) rotated by ``sign`` times the angles."""
    *lead, tokens, width = k.shape
    heads = width // rope.head_dim
    half = rope.head_dim // 2
    x = k.reshape(*lead, tokens, heads, 2, half)
    cos, sin = rope.angles(positions)
    cos, sin = cos[:, None, :], sign * sin[:, None, :]  # broadcast over heads
    x1, x2 = x[..., 0, :], x[..., 1, :]
    out = torch_stack(x1 * cos - x2 * sin, x2 * cos + x1 * sin)
    return out.reshape(*lead, tokens, width)


def torch_stack(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.stack((a, b), dim=-2)


def apply(k: torch.Tensor, rope: Rope, positions: torch.Tensor) -> torch.Tensor:
    """RoPE applied to unrotated keys (what the model does)."""
    return _rotate(k, rope, positions, 1.0)


def undo(k: torch.Tensor, rope: Rope, positions: torch.Tensor) -> torch.Tensor:
    """Rotated keys back to unrotated ones (the inverse rotation)."""
    return _rotate(k, rope, positions, -1.0)


def fits(rope: Rope, channels: int) -> bool:
    return rope.head_dim >= 2 and rope.head_dim % 2 == 0 and channels % rope.head_dim == 0
