"""Listing the keys of a Store: sorted pages over its memory tier and every lower tier that can
list, each key once.

Sources are not sorted (a dict, Redis' SCAN) and may hold millions of keys, so a listing reads
them all once, at its first page, into a sorted snapshot; each later page is a bisection into
it. Scanning every source for every page instead made reading all of a 1M-key tier page by
page quadratic (1000 pages, each a full scan). The price is freshness: a listing shows the keys
as they were at its first page (a key deleted since is still listed, one put since is not),
like a paginated S3 listing. A page that finds no snapshot (the first, one past ``SNAPSHOT_TTL``,
or one evicted by ``MAX_SNAPSHOTS`` other prefixes) reads the sources again.

A key held by several tiers is listed with the size the fastest tier reports (the object's
bytes in memory, the stored frame below). A tier that fails while listing is skipped and
logged, like a tier that fails a get: a listing is a best-effort view, never a failed request.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

from gateway.errors import GatewayError
from gateway.store import Store
from gateway.types import ObjectInfo

log = logging.getLogger("kvgate.listing")

MAX_PAGE = 1000
SNAPSHOT_TTL = 60.0  # seconds a listing's later pages may read its first page's snapshot
MAX_SNAPSHOTS = 8  # prefixes listed at once; each snapshot holds a reference per key
_YIELD_EVERY = 4096  # keys read between two turns of the event loop


@dataclass(frozen=True, slots=True)
class _Snapshot:
    keys: list[str]  # sorted
    sizes: list[int]  # sizes[i] belongs to keys[i]
    taken: float  # time.monotonic()


class KeyListings:
    """Sorted, paginated listings of one Store's keys; the pages of a listing share a snapshot."""

    def __init__(
        self, store: Store, *, ttl: float = SNAPSHOT_TTL, max_snapshots: int = MAX_SNAPSHOTS
    ) -> None:
        self._store = store
        self._ttl = ttl
        self._max = max_snapshots
        self._snapshots: OrderedDict[str, _Snapshot] = OrderedDict()
        self._taking: dict[str, asyncio.Future[_Snapshot]] = {}  # first pages being read

    async def page(
        self, prefix: str = "", *, limit: int = MAX_PAGE, after: str | None = None
    ) -> tuple[list[ObjectInfo], str | None]:
        """Up to ``limit`` keys starting with ``prefix``, sorted, after the cursor ``after``.

        Returns the page and the cursor of the next one (None when this page is the last). A
        page without a cursor starts a new listing, so it reads the sources again.
        """
        if not 1 <= limit <= MAX_PAGE:
            raise ValueError(f"limit must be in 1..{MAX_PAGE}")
        snap = None if after is None else self._fresh(prefix)
        if snap is None:
            snap = await self._take(prefix)
        start = 0 if after is None else bisect.bisect_right(snap.keys, after)
        end = min(start + limit, len(snap.keys))
        items = [ObjectInfo(snap.keys[i], snap.sizes[i]) for i in range(start, end)]
        return items, (items[-1].key if end < len(snap.keys) else None)

    def _fresh(self, prefix: str) -> _Snapshot | None:
        snap = self._snapshots.get(prefix)
        if snap is None or time.monotonic() - snap.taken > self._ttl:
            return None
        self._snapshots.move_to_end(prefix)
        return snap

    async def _take(self, prefix: str) -> _Snapshot:
        """A new snapshot of ``prefix``; first pages that come while one is read share it."""
        taking = self._taking.get(prefix)
        if taking is None:
            taking = self._taking[prefix] = asyncio.ensure_future(self._read(prefix))
            taking.add_done_callback(lambda _: self._taking.pop(prefix, None))
        return await asyncio.shield(taking)

    async def _read(self, prefix: str) -> _Snapshot:
        taken = time.monotonic()
        sources = await _read_sources(self._store, prefix)
        # Merging and sorting a million keys takes about a second: off the event loop.
        keys, sizes = await asyncio.to_thread(_merge_sorted, sources)
        snap = _Snapshot(keys, sizes, taken)
        now = time.monotonic()
        for old in [p for p, s in self._snapshots.items() if now - s.taken > self._ttl]:
            del self._snapshots[old]  # lapsed: no page may read it, so it only holds memory
        self._snapshots[prefix] = snap
        self._snapshots.move_to_end(prefix)
        while len(self._snapshots) > self._max:
            self._snapshots.popitem(last=False)
        return snap


async def _read_sources(store: Store, prefix: str) -> list[list[tuple[str, int]]]:
    """Each source's ``(key, size)`` pairs under ``prefix``, fastest tier first."""
    sources: list[list[tuple[str, int]]] = []
    if store.l1 is not None:
        sources.append(
            [
                (key, entry.meta.nbytes)
                for key, entry in list(store.l1.index.items())
                if key.startswith(prefix) and not entry.expired()
            ]
        )
    for tier in store.tiers:
        if not tier.connector.capabilities.list:
            continue
        pairs: list[tuple[str, int]] = []
        try:
            async for info in tier.connector.list(prefix):
                pairs.append((info.key, info.size))
                if len(pairs) % _YIELD_EVERY == 0:
                    # A tier that lists from memory (the disk tier's index) never waits, so
                    # the loop would run nothing else for the seconds a million keys take.
                    await asyncio.sleep(0)
        except GatewayError as exc:
            log.warning("tier %s could not list %r; skipped: %s", tier.name, prefix, exc)
            continue
        sources.append(pairs)
    return sources


def _merge_sorted(sources: list[list[tuple[str, int]]]) -> tuple[list[str], list[int]]:
    """The keys of all sources, sorted and each once, with the size its first source gives."""
    merged: dict[str, int] = {}
    for pairs in sources:
        for key, size in pairs:
            merged.setdefault(key, size)
    keys = sorted(merged)
    return keys, [merged[k] for k in keys]
