"""Listing the keys of a Store: one sorted, paginated view over its memory tier and every lower
tier that can list.

Sources are not sorted and may be large, so a page is the ``limit`` smallest keys after the
cursor, kept in a bounded heap while every source is scanned once: memory stays O(limit)
whatever the store holds. A key held by several tiers is listed once, with the size the
fastest tier reports (the object's bytes in memory, the stored frame below). A tier that fails
while listing is skipped and logged, like a tier that fails a get: a listing is a best-effort
view, never a failed request.
"""

from __future__ import annotations

import heapq
import logging

from gateway.errors import GatewayError
from gateway.store import Store
from gateway.types import ObjectInfo

log = logging.getLogger("kvgate.listing")

MAX_PAGE = 1000


class _Page:
    """The ``limit`` smallest keys seen so far (a max-heap by key), each with its first size."""

    def __init__(self, limit: int, after: str | None) -> None:
        self.limit = limit
        self.after = after
        self.heap: list[tuple[_Desc, int]] = []
        self.sizes: dict[str, int] = {}

    def offer(self, key: str, size: int) -> None:
        if (self.after is not None and key <= self.after) or key in self.sizes:
            return
        if len(self.heap) < self.limit:
            heapq.heappush(self.heap, (_Desc(key), size))
            self.sizes[key] = size
        elif key < self.heap[0][0].key:
            dropped, _ = heapq.heapreplace(self.heap, (_Desc(key), size))
            del self.sizes[dropped.key]
            self.sizes[key] = size

    def items(self) -> list[ObjectInfo]:
        return [ObjectInfo(k, self.sizes[k]) for k in sorted(self.sizes)]


class _Desc:
    """A key ordered backwards, so that heapq's min-heap keeps the largest key on top."""

    __slots__ = ("key",)

    def __init__(self, key: str) -> None:
        self.key = key

    def __lt__(self, other: _Desc) -> bool:
        return self.key > other.key


async def list_keys(
    store: Store, prefix: str = "", *, limit: int = MAX_PAGE, after: str | None = None
) -> tuple[list[ObjectInfo], str | None]:
    """One page of keys starting with ``prefix``, sorted, after the cursor ``after``.

    Returns the page and the cursor of the next one (None when this page is the last).
    """
    if not 1 <= limit <= MAX_PAGE:
        raise ValueError(f"limit must be in 1..{MAX_PAGE}")
    # One more than asked: whether a next page exists, without a second scan.
    page = _Page(limit + 1, after)
    if store.l1 is not None:
        for key, entry in list(store.l1.index.items()):
            if key.startswith(prefix) and not entry.expired():
                page.offer(key, entry.meta.nbytes)
    for tier in store.tiers:
        if not tier.connector.capabilities.list:
            continue
        try:
            async for info in tier.connector.list(prefix):
                page.offer(info.key, info.size)
        except GatewayError as exc:
            log.warning("tier %s could not list %r; skipped: %s", tier.name, prefix, exc)
    items = page.items()
    if len(items) > limit:
        return items[:limit], items[limit - 1].key
    return items, None
