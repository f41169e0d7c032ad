"""Moving a chunk's pages between vLLM's paged KV cache and one chunk tensor.

vLLM keeps one tensor per attention layer; one of its dimensions indexes blocks (dim 0 on the
CPU backend, ``[blocks, kv_heads, block_size, 2 * head_dim]``; dim 1 on CUDA backends,
``[2, blocks, block_size, kv_heads, head_dim]``). What lies inside a block depends on the
backend and, on CPU, on the ISA path (K transposed, say), so a block's slice is moved as it is,
never interpreted. A chunk tensor is the layers' slices stacked: ``[layers, *layer shape with
the block dimension cut to the chunk's blocks]``, in the cache's dtype and device. The same
code runs on a CUDA device (torch's ``index_select``/``index_copy_`` are its kernels there), and
a chunk fetched to the host is moved to the cache's device before it is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class PagedLayout:
    """How the layers' caches are laid out: what must match for a chunk to be loaded."""

    block_dim: int
    layer_shape: tuple[int, ...]  # one layer's cache shape
    dtype: torch.dtype
    device: torch.device
    layers: int

    @classmethod
    def of(cls, caches: Sequence[torch.Tensor], num_blocks: int) -> PagedLayout:
        """The layout of ``caches`` (one per layer, all alike), whose block dimension is the
        one of size ``num_blocks`` (the first such)."""
        if not caches:
            raise ValueError("no KV cache tensors")
        first = caches[0]
        for cache in caches[1:]:
            if cache.shape != first.shape or cache.dtype != first.dtype:
                raise ValueError("the layers' KV caches differ in shape or dtype")
        dims = [d for d, size in enumerate(first.shape) if size == num_blocks]
        if not dims:
            raise ValueError(f"no dimension of {tuple(first.shape)} has {num_blocks} blocks")
        return cls(dims[0], tuple(first.shape), first.dtype, first.device, len(caches))

    def tag(self) -> str:
        """The layout as a key tag value: device type and shape with the block dimension as B
        (a chunk stored under another layout is never loaded into this one)."""
        dims = ["B" if d == self.block_dim else str(n) for d, n in enumerate(self.layer_shape)]
        return f"{self.device.type}:{'x'.join(dims)}"

    def chunk_shape(self, blocks: int) -> tuple[int, ...]:
        shape = list(self.layer_shape)
        shape[self.block_dim] = blocks
        return (self.layers, *shape)


def gather(
    caches: Sequence[torch.Tensor], layout: PagedLayout, block_ids: Sequence[int]
) -> torch.Tensor:
    """A new chunk tensor holding a copy of blocks ``block_ids`` of every layer."""
    index = torch.as_tensor(list(block_ids), dtype=torch.long, device=layout.device)
    out = torch.empty(layout.chunk_shape(len(block_ids)), dtype=layout.dtype, device=layout.device)
    for layer, cache in enumerate(caches):
        torch.index_select(cache, layout.block_dim, index, out=out[layer])
    return out


def scatter(
    caches: Sequence[torch.Tensor],
    layout: PagedLayout,
    chunk: torch.Tensor,
    block_ids: Sequence[int],
    skip: int = 0,
) -> None:
    """Write ``chunk``'s blocks from ``skip`` on into blocks ``block_ids[skip:]`` of every
    layer. Raises ``ValueError`` when the chunk does not have this layout's shape and dtype."""
    want = layout.chunk_shape(len(block_ids))
    if tuple(chunk.shape) != want or chunk.dtype != layout.dtype:
        raise ValueError(
            f"a chunk of shape {tuple(chunk.shape)} {chunk.dtype} where {want} {layout.dtype} "
            "was expected"
        )
    if skip >= len(block_ids):
        return
    src = chunk.to(layout.device, non_blocking=True)
    index = torch.as_tensor(list(block_ids[skip:]), dtype=torch.long, device=layout.device)
    count = len(block_ids) - skip
    for layer, cache in enumerate(caches):
        cache.index_copy_(layout.block_dim, index, src[layer].narrow(layout.block_dim, skip, count))
