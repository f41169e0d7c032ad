"""How much of a store's pool a server's uploads may hold before their bytes have arrived.

A server that receives an object into the store's own memory (``Store.reserve``, then
``put(staged=...)``) saves a copy of every object, but it takes that memory when the length is
declared, not as the bytes come: the memory tier may evict to make room. A client that
declares large uploads and then stalls would make the cache evict that much and hold it until
the server's pace limits close the connection. ``StagingAllowance`` bounds what all uploads
of one server hold that way together (an eighth of the pool, or the server's own cap when
lower); past it, the server receives into its own buffers and the put copies, as before. So
a stalled declaration costs the cache at most that share, never the room that other puts
need.
"""

from __future__ import annotations

from gateway.memory import Slab
from gateway.store import Store

POOL_SHARE = 8  # uploads may hold 1/POOL_SHARE of the pool before their bytes arrive


class StagingAllowance:
    def __init__(self, store: Store, cap: int | None = None) -> None:
        self.store = store
        self.cap = cap  # a bound of the server's own, below the pool's share
        self.held = 0

    @property
    def limit(self) -> int:
        """What uploads may hold together: the pool's share (the pool exists once the store is
        open), or the server's own cap when lower."""
        pool = self.store.pool
        share = pool.capacity // POOL_SHARE if pool is not None else 0
        return share if self.cap is None else min(self.cap, share)

    def reserve(self, nbytes: int) -> Slab | None:
        """A slab of the store's pool for an upload of ``nbytes``, or None (receive it into
        the server's own memory) when that would pass the allowance or the pool has none."""
        if nbytes <= 0 or self.held + nbytes > self.limit:
            return None
        slab = self.store.reserve(nbytes)
        if slab is not None:
            self.held += nbytes
        return slab

    def give_back(self, slab: Slab) -> None:
        """The upload is over (stored, refused or cut short): release ``slab``."""
        self.held -= slab.nbytes
        slab.release()
