"""The worker side's work, without vLLM: chunks from the store into the paged cache, and the
paged cache's full chunks out to the store. ``KvgateConnector`` calls it from vLLM's hooks.

A chunk that does not load (a miss, something that is not a tensor, another layout) is never
half-used: its blocks are reported back, and vLLM recomputes them. A chunk that is there but
not a tensor at all is deleted too: it passed the lookup, so every later request for its
prefix would plan its load, fail it and recompute it, and, since what is held is never saved
again, the recomputed chunk would never replace it. (A tensor of another shape is left: keys
do not name the number of layers, so it may be another deployment's good chunk.)
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import torch

from gateway.keys import Key
from gateway.vllm.bridge import StoreThread
from gateway.vllm.pages import PagedLayout, gather, scatter
from gateway.vllm.plan import ChunkMove

log = logging.getLogger("kvgate.vllm")


class PagedWorker:
    """One worker's paged cache and the store it saves to and loads from."""

    def __init__(
        self, bridge: StoreThread, *, model_id: str, world_size: int, rank: int, chunk_size: int
    ) -> None:
        self.bridge = bridge
        self.model_id = model_id
        self.world_size = world_size
        self.rank = rank
        self.chunk_size = chunk_size
        self.caches: list[torch.Tensor] = []
        self.layout: PagedLayout | None = None
        self.loaded_chunks = self.failed_chunks = self.saved_chunks = 0

    def register(self, caches: Sequence[torch.Tensor], num_blocks: int) -> None:
        self.caches = list(caches)
        self.layout = PagedLayout.of(self.caches, num_blocks)

    def key(self, chunk_hash: int) -> str:
        """The chunk's key: model, ranks, hash, the cache's dtype, its layout, chunk size."""
        layout = self.layout
        if layout is None:
            raise RuntimeError("the KV caches are not registered yet")
        dtype = str(layout.dtype).removeprefix("torch.")
        tags = (("vllm", layout.tag()), ("chunk", str(self.chunk_size)))
        return str(Key(self.model_id, self.world_size, self.rank, chunk_hash, dtype, tags))

    def load(self, moves: Sequence[ChunkMove]) -> set[int]:
        """Write ``moves``' chunks into their blocks; the block ids that could not be."""
        if not moves:
            return set()
        layout = self.layout
        if layout is None:  # nothing registered: nothing can be loaded
            return {b for m in moves for b in m.block_ids[m.skip :]}
        failed: set[int] = set()
        found = self.bridge.get_many([self.key(m.chunk_hash) for m in moves])
        for move, chunk in zip(moves, found, strict=True):
            try:
                if not isinstance(chunk, torch.Tensor):
                    raise ValueError("a miss" if chunk is None else "not a tensor")
                scatter(self.caches, layout, chunk, move.block_ids, move.skip)
                self.loaded_chunks += 1
            except ValueError as exc:  # vLLM recomputes these blocks
                self.failed_chunks += 1
                failed.update(move.block_ids[move.skip :])
                if isinstance(chunk, torch.Tensor) or chunk is None:
                    # A tensor of another shape may be another deployment's good chunk
                    # (keys do not say the number of layers): left alone.
                    log.debug("kvgate: chunk %d not loaded: %s", move.index, exc)
                    continue
                key = self.key(move.chunk_hash)
                deleted = self.bridge.delete_later(key)
                log.warning(
                    "kvgate: chunk %d under %s not usable (%s): recomputed%s",
                    move.index,
                    key,
                    exc,
                    ", and deleted from the store" if deleted else "",
                )
        return failed

    def save(self, moves: Iterable[ChunkMove]) -> None:
        """Copy each chunk's pages out (the only wait) and hand the copy to the store."""
        layout = self.layout
        if layout is None:
            return
        for move in moves:
            chunk = gather(self.caches, layout, move.block_ids)
            position = move.index * self.chunk_size  # the chunk's first token
            if self.bridge.put_later(self.key(move.chunk_hash), chunk, position):
                self.saved_chunks += 1
