"""The scheduler side's bookkeeping: which chunks of which request to load or save, and into
or out of which blocks. Pure Python (no vLLM, no torch), so that it is tested on its own.

A chunk is ``chunk_size`` tokens, whole vLLM blocks (``blocks_per_chunk`` of them), keyed by
the prefix hash of its tokens (LMCache's chain, ``gateway.keys``), so a chunk's key says which
tokens came before it. Rules:

- lookup asks the store how many leading chunks of the prompt it holds, leaving at least one
  prompt token for vLLM to compute (it needs one to produce the first output);
- a load covers the chunks past what vLLM already holds (its own prefix cache); blocks of a
  chunk that vLLM holds already are not written (``ChunkMove.skip``);
- a chunk is saved once, in the step after which all its tokens have KV (prompt or generated),
  unless it was loaded or already saved.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from gateway.keys import hash_to_int, lmcache_prefix_hashes, none_hash

Lookup = Callable[[Sequence[int]], int]
"""Chunk hashes (leading first) -> how many leading ones the store holds (0 on failure)."""


@dataclass(frozen=True, slots=True)
class ChunkMove:
    """One chunk to load into, or save from, the paged cache."""

    index: int  # the chunk's place in its request (token index // chunk_size)
    chunk_hash: int
    block_ids: tuple[int, ...]  # its blocks, in token order
    skip: int = 0  # leading blocks vLLM holds already: a load does not write them


@dataclass(frozen=True, slots=True)
class NewRequest:
    """What a step's scheduler output says of a request scheduled for the first time."""

    req_id: str
    block_ids: Sequence[int]
    computed_after: int  # tokens with KV once this step has run


@dataclass(frozen=True, slots=True)
class RunningRequest:
    """What a step's scheduler output says of a request scheduled before."""

    req_id: str
    new_block_ids: Sequence[int] | None  # blocks added this step (all of them if resumed)
    resumed: bool  # preempted and rescheduled: its block list starts over
    computed_after: int


@dataclass
class _Tracked:
    tokens: Callable[[], Sequence[int]]  # the request's tokens so far (prompt, then output)
    hashes: list[int] = field(default_factory=list)  # chunk hashes known so far
    block_ids: list[int] = field(default_factory=list)
    held: int = 0  # leading chunks the store holds (loaded, or saved by this engine)
    load: list[ChunkMove] = field(default_factory=list)  # planned, not yet sent to the worker
    matched: int = 0  # chunks the last lookup found
    computed: int = 0  # tokens vLLM held itself at the last lookup (its prefix cache)


class Planner:
    def __init__(self, chunk_size: int, block_size: int, seed: str, lookup: Lookup) -> None:
        if chunk_size % block_size:
            raise ValueError(f"chunk_size {chunk_size} is not a multiple of {block_size}")
        self.chunk_size = chunk_size
        self.blocks_per_chunk = chunk_size // block_size
        self.block_size = block_size
        self._root = hash_to_int(none_hash(seed))
        self._lookup = lookup
        self._requests: dict[str, _Tracked] = {}

    # -- get_num_new_matched_tokens --------------------------------------------------------

    def matched_tokens(
        self, req_id: str, prompt: Sequence[int], tokens: Callable[[], Sequence[int]], computed: int
    ) -> int:
        """How many tokens past ``computed`` (vLLM's own hits) the store can load."""
        tracked = self._requests.setdefault(req_id, _Tracked(tokens))
        usable = (len(prompt) - 1) // self.chunk_size  # whole chunks, one token left to run
        hashes = self._hashes(tracked, prompt, usable)
        found = self._lookup(hashes) if usable else 0
        tracked.matched, tracked.computed = found, computed
        return max(0, found * self.chunk_size - computed)

    # -- update_state_after_alloc ------------------------------------------------------------

    def allocated(self, req_id: str, external: int) -> None:
        """Blocks were given to the request: ``external`` tokens past what vLLM holds itself
        will be loaded into them, at the request's first step."""
        tracked = self._requests.get(req_id)
        if tracked is None or external <= 0:
            return
        computed = tracked.computed
        first = computed // self.chunk_size
        last = min(-(-(computed + external) // self.chunk_size), tracked.matched)
        held_blocks = computed // self.block_size
        tracked.load = [
            ChunkMove(i, tracked.hashes[i], (), max(0, held_blocks - i * self.blocks_per_chunk))
            for i in range(first, last)
        ]
        tracked.held = max(tracked.held, last)

    # -- build_connector_meta ---------------------------------------------------------------

    def step(
        self, new: Sequence[NewRequest], running: Sequence[RunningRequest]
    ) -> tuple[dict[str, list[ChunkMove]], dict[str, list[ChunkMove]]]:
        """This step's loads and saves, by request."""
        loads: dict[str, list[ChunkMove]] = {}
        saves: dict[str, list[ChunkMove]] = {}
        for req in new:
            tracked = self._requests.get(req.req_id)
            if tracked is None:
                continue
            tracked.block_ids = list(req.block_ids)
            self._loads(req.req_id, tracked, loads)
            self._saves(req.req_id, tracked, req.computed_after, saves)
        for run in running:
            tracked = self._requests.get(run.req_id)
            if tracked is None:
                continue
            if run.resumed:
                tracked.block_ids = list(run.new_block_ids or ())
            elif run.new_block_ids:
                tracked.block_ids.extend(run.new_block_ids)
            # A preempted request starts over from its prefix: vLLM asked for its matched
            # tokens again, and the chunks it planned go into its new blocks in this step.
            # (Without this vLLM counted them as loaded and computed on blocks never written.)
            self._loads(run.req_id, tracked, loads)
            self._saves(run.req_id, tracked, run.computed_after, saves)
        return loads, saves

    def _loads(self, req_id: str, tracked: _Tracked, loads: dict[str, list[ChunkMove]]) -> None:
        """The planned loads of a request whose block list is known, then forgotten."""
        if not tracked.load:
            return
        blocks = tracked.block_ids
        loads[req_id] = [
            ChunkMove(m.index, m.chunk_hash, self._chunk_blocks(blocks, m.index), m.skip)
            for m in tracked.load
        ]
        tracked.load = []

    def _saves(
        self, req_id: str, tracked: _Tracked, computed_after: int, saves: dict[str, list[ChunkMove]]
    ) -> None:
        full = min(
            computed_after // self.chunk_size, len(tracked.block_ids) // self.blocks_per_chunk
        )
        if full <= tracked.held:
            return
        hashes = self._hashes(tracked, tracked.tokens(), full)
        saves[req_id] = [
            ChunkMove(i, hashes[i], self._chunk_blocks(tracked.block_ids, i))
            for i in range(tracked.held, full)
        ]
        tracked.held = full

    # -- request_finished --------------------------------------------------------------------

    def finished(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def tracked(self) -> int:
        return len(self._requests)

    # -- helpers --------------------------------------------------------------------------------

    def _chunk_blocks(self, block_ids: Sequence[int], index: int) -> tuple[int, ...]:
        start = index * self.blocks_per_chunk
        return tuple(block_ids[start : start + self.blocks_per_chunk])

    def _hashes(self, tracked: _Tracked, tokens: Sequence[int], count: int) -> list[int]:
        """The first ``count`` chunk hashes of ``tokens``, extending the cached chain."""
        while len(tracked.hashes) < count:
            i = len(tracked.hashes)
            parent = tracked.hashes[-1] if tracked.hashes else self._root
            window = list(tokens[i * self.chunk_size : (i + 1) * self.chunk_size])
            tracked.hashes += lmcache_prefix_hashes(window, self.chunk_size, parent=parent)
        return tracked.hashes[:count]


def saves_after_loads(
    loads: Mapping[str, Sequence[ChunkMove]],
    saves: Mapping[str, Sequence[ChunkMove]],
    failed_blocks: set[int],
) -> list[ChunkMove]:
    """A step's saves, less those computed over a load that failed in the same step.

    A request's chunks past a chunk whose load failed were computed by attending to blocks
    nobody wrote: vLLM recomputes them (it is told the failed blocks), but saved they would
    be wrong KV under a right key, loaded by every later request with that prefix.
    """
    kept: list[ChunkMove] = []
    for req_id, moves in saves.items():
        failed = [
            m.index for m in loads.get(req_id, ()) if failed_blocks & set(m.block_ids[m.skip :])
        ]
        first_bad = min(failed, default=None)
        kept += [m for m in moves if first_bad is None or m.index < first_bad]
    return kept
