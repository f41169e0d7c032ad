"""Keys a tier holds an object under that this store cannot read: left out of its lookups.

A read leaves some objects in place rather than deleting them (too large for this reader, not
written by kvgate, encrypted under a key this process lacks, needing a side object the tier
lacks): they may be another reader's. But the tier still answers "here" for them, so a lookup
counted them and every get then missed; vLLM's scheduler, told a prefix was stored, planned to
load it, recomputed the chunk when the load failed, and never saved it again because the next
lookup said it was stored. ``UnreadableKeys`` remembers such keys for a while, so that lookups
answer "not here" and the engine saves its own object under the key (which clears the mark).

Bounded in count (oldest forgotten first) and in time: another writer may replace the object
with one this store can read, and after ``ttl`` the key is looked up as usual again. A read
that ends after this store wrote or deleted the key (``written``) marks nothing: what it read
is gone (reads say when they start and end: ``begin_read``, ``end_read``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

UNREADABLE_KEYS = 65536  # keys remembered per tier (10-80 MB at most, as keys are 0-1 KiB)
UNREADABLE_TTL = 300.0  # seconds a key stays left out of lookups


class UnreadableKeys:
    """Keys whose object this store read and left in place, each until ``ttl`` passes."""

    def __init__(
        self,
        limit: int = UNREADABLE_KEYS,
        ttl: float = UNREADABLE_TTL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = limit
        self.ttl = ttl
        self._clock = clock
        self._until: OrderedDict[str, float] = OrderedDict()  # key -> when it is forgotten
        self._reading: dict[str, int] = {}  # keys being read -> reads under way
        self._overwritten: set[str] = set()  # of those, keys written or deleted meanwhile

    def __len__(self) -> int:
        return len(self._until)

    def add(self, key: str) -> None:
        self._until[key] = self._clock() + self.ttl
        self._until.move_to_end(key)
        while len(self._until) > self.limit:
            self._until.popitem(last=False)

    def discard(self, key: str) -> None:
        """The tier now holds an object of this store's under the key, or none."""
        if self._until:  # the common case: nothing marked, no hashing of the key
            self._until.pop(key, None)

    def written(self, key: str) -> None:
        """This store wrote or deleted ``key`` in the tier: unmarked, and a read of it under
        way read what is gone."""
        self.discard(key)
        if key in self._reading:
            self._overwritten.add(key)

    def begin_read(self, key: str) -> None:
        self._reading[key] = self._reading.get(key, 0) + 1

    def end_read(self, key: str, unreadable: bool | None) -> None:
        """The read ``begin_read`` began ended: it left the object in place (True), found it
        readable or absent (False), or failed (None: nothing learnt)."""
        raced = key in self._overwritten
        left = self._reading[key] - 1
        if left:
            self._reading[key] = left
        else:
            del self._reading[key]
            self._overwritten.discard(key)
        if unreadable and not raced:
            self.add(key)
        elif unreadable is False:
            self.discard(key)

    def hide(self, keys: Sequence[str], flags: list[bool]) -> list[bool]:
        """``flags`` (whether the tier holds each of ``keys``) with marked keys as absent."""
        if not self._until:
            return flags
        now = self._clock()
        out = list(flags)
        for i, (key, flag) in enumerate(zip(keys, flags, strict=False)):
            if not flag:
                continue
            until = self._until.get(key)
            if until is None:
                continue
            if until > now:
                out[i] = False
            else:
                del self._until[key]
        return out
