"""Eviction policies for byte-capacity caches: LRU, MRU, FIFO, LFU and S3-FIFO.

A policy only orders keys; the cache that owns it keeps the bytes and the byte count. The cache
calls ``insert`` when it stores a key, ``touch`` on a hit, ``remove`` when a key is deleted or
dropped for another reason, and ``victim`` while it is over capacity. ``victim`` removes the key
it returns from the policy, so the cache must then drop that key's bytes.

``victim(evictable)`` lets the cache protect keys it cannot drop right now (being read, pinned,
dirty and not yet written down): such keys are skipped and stay in the policy. LRU, MRU, FIFO and
LFU never reorder a key they skip. S3-FIFO moves skipped keys to the tail of their queue, since
a FIFO scan can only step past a key by moving it; that is allowed because S3-FIFO's order is
already rewritten by every eviction (promotions, reinsertions).

Not thread-safe by design: every policy is owned by one tier and used from the one event-loop
thread that runs it, so locking would only cost time.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from gateway.errors import ConfigError

K = TypeVar("K", bound=Hashable)

__all__ = [
    "POLICY_NAMES",
    "EvictionPolicy",
    "FIFOPolicy",
    "LFUPolicy",
    "LRUPolicy",
    "MRUPolicy",
    "S3FIFOPolicy",
    "make_policy",
]


@runtime_checkable
class EvictionPolicy(Protocol[K]):
    """What a byte-capacity cache needs from an eviction policy."""

    name: str

    def insert(self, key: K, size: int) -> None:
        """Record a newly stored key of ``size`` bytes; a present key is removed first."""
        ...

    def touch(self, key: K) -> None:
        """Record a hit on ``key``; no-op if absent."""
        ...

    def remove(self, key: K) -> None:
        """Forget ``key`` (deleted or overwritten); no-op if absent."""
        ...

    def victim(self, evictable: Callable[[K], bool] | None = None) -> K | None:
        """Choose the next key to evict, remove it from the policy and return it.

        Keys for which ``evictable(key)`` is false are skipped and stay. ``None`` when no
        present key is evictable (including when the policy is empty).
        """
        ...

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...

    def keys_in_eviction_order(self) -> list[K]:
        """The keys in the order successive ``victim()`` calls would return them (diagnostics)."""
        ...


def _check_size(size: int) -> None:
    if size < 0:
        raise ValueError(f"object size must be >= 0 bytes, got {size}")


class _OrderedPolicy(Generic[K]):
    """Shared body of the three single-queue policies, on one OrderedDict (oldest first).

    Every operation is O(1); ``victim`` is O(1) plus one step per skipped key.
    """

    name: str = "ordered"
    # On a hit, move the key to the newest end (LRU, MRU) or leave it where it is (FIFO).
    _move_on_touch: bool = True
    # Evict from the newest end (MRU) instead of the oldest (LRU, FIFO).
    _evict_newest: bool = False

    def __init__(self) -> None:
        # Values are unused; OrderedDict is kept for its O(1) move_to_end and ordered pops.
        self._order: OrderedDict[K, None] = OrderedDict()

    def insert(self, key: K, size: int) -> None:
        _check_size(size)
        # An overwrite is a new object: it goes to the newest end like any other insert.
        self._order.pop(key, None)
        self._order[key] = None

    def touch(self, key: K) -> None:
        if self._move_on_touch and key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: K) -> None:
        self._order.pop(key, None)

    def _scan(self) -> Iterator[K]:
        return reversed(self._order) if self._evict_newest else iter(self._order)

    def victim(self, evictable: Callable[[K], bool] | None = None) -> K | None:
        if not self._order:
            return None
        if evictable is None:
            key, _ = self._order.popitem(last=self._evict_newest)
            return key
        # Find first, delete after: deleting while iterating an OrderedDict is an error, and
        # skipped keys must keep their positions.
        chosen = next((key for key in self._scan() if evictable(key)), None)
        if chosen is not None:
            del self._order[chosen]
        return chosen

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def keys_in_eviction_order(self) -> list[K]:
        return list(self._scan())

    def __repr__(self) -> str:
        return f"<{type(self).__name__} keys={len(self)}>"


class LRUPolicy(_OrderedPolicy[K]):
    """Least recently used: evicts the key whose last insert or hit is oldest."""

    name = "lru"


class MRUPolicy(_OrderedPolicy[K]):
    """Most recently used: evicts the key inserted or hit last (good for one-pass scans)."""

    name = "mru"
    _evict_newest = True


class FIFOPolicy(_OrderedPolicy[K]):
    """First in, first out: evicts in insertion order; hits do not change the order."""

    name = "fifo"
    _move_on_touch = False


class _FrequencyBucket(Generic[K]):
    """The keys hit exactly ``frequency`` times, least recently used first.

    Buckets form a doubly linked list in increasing frequency, so the least frequent bucket is
    always the first one and moving a key up one frequency is O(1), with no search for the next
    non-empty frequency after a removal.
    """

    __slots__ = ("frequency", "keys", "newer", "older")

    def __init__(self, frequency: int) -> None:
        self.frequency = frequency
        self.keys: OrderedDict[K, None] = OrderedDict()
        # Neighbours in the frequency list; the sentinel closes the ring, so never None in use.
        self.newer: _FrequencyBucket[K] = self
        self.older: _FrequencyBucket[K] = self


class LFUPolicy(Generic[K]):
    """Least frequently used, ties broken by least recently used; every operation O(1).

    An insert (including an overwrite) starts the key at frequency 1; each hit adds one.
    """

    name = "lfu"

    def __init__(self) -> None:
        # Sentinel of the circular bucket list: sentinel.newer is the least frequent bucket.
        # The field names read as "higher frequency" (newer) and "lower frequency" (older).
        self._sentinel: _FrequencyBucket[K] = _FrequencyBucket(0)
        self._bucket_of: dict[K, _FrequencyBucket[K]] = {}

    def _link_after(self, anchor: _FrequencyBucket[K], frequency: int) -> _FrequencyBucket[K]:
        bucket: _FrequencyBucket[K] = _FrequencyBucket(frequency)
        bucket.older = anchor
        bucket.newer = anchor.newer
        anchor.newer.older = bucket
        anchor.newer = bucket
        return bucket

    @staticmethod
    def _unlink(bucket: _FrequencyBucket[K]) -> None:
        bucket.older.newer = bucket.newer
        bucket.newer.older = bucket.older

    def _detach(self, key: K) -> _FrequencyBucket[K]:
        """Take ``key`` out of its bucket, dropping the bucket if it empties; return the bucket."""
        bucket = self._bucket_of.pop(key)
        del bucket.keys[key]
        if not bucket.keys:
            self._unlink(bucket)
        return bucket

    def insert(self, key: K, size: int) -> None:
        _check_size(size)
        if key in self._bucket_of:
            self._detach(key)
        first = self._sentinel.newer
        if first is self._sentinel or first.frequency != 1:
            first = self._link_after(self._sentinel, 1)
        first.keys[key] = None
        self._bucket_of[key] = first

    def touch(self, key: K) -> None:
        bucket = self._bucket_of.get(key)
        if bucket is None:
            return
        target_frequency = bucket.frequency + 1
        next_bucket = bucket.newer
        if next_bucket is self._sentinel or next_bucket.frequency != target_frequency:
            # Link the new bucket before detaching, while ``bucket`` is still in the list.
            next_bucket = self._link_after(bucket, target_frequency)
        self._detach(key)
        next_bucket.keys[key] = None
        self._bucket_of[key] = next_bucket

    def remove(self, key: K) -> None:
        if key in self._bucket_of:
            self._detach(key)

    def _buckets(self) -> Iterator[_FrequencyBucket[K]]:
        bucket = self._sentinel.newer
        while bucket is not self._sentinel:
            yield bucket
            bucket = bucket.newer

    def victim(self, evictable: Callable[[K], bool] | None = None) -> K | None:
        if evictable is None:
            first = self._sentinel.newer
            if first is self._sentinel:
                return None
            chosen: K | None = next(iter(first.keys))
        else:
            chosen = next(
                (key for bucket in self._buckets() for key in bucket.keys if evictable(key)),
                None,
            )
        if chosen is not None:
            self._detach(chosen)
        return chosen

    def frequency(self, key: K) -> int:
        """The key's hit count plus one (its insert), or 0 if absent; for tests and diagnostics."""
        bucket = self._bucket_of.get(key)
        return 0 if bucket is None else bucket.frequency

    def __len__(self) -> int:
        return len(self._bucket_of)

    def __contains__(self, key: object) -> bool:
        return key in self._bucket_of

    def keys_in_eviction_order(self) -> list[K]:
        return [key for bucket in self._buckets() for key in bucket.keys]

    def __repr__(self) -> str:
        return f"<LFUPolicy keys={len(self)}>"


class S3FIFOPolicy(Generic[K]):
    """S3-FIFO (Yang et al., SOSP 2023): a small FIFO filters one-hit wonders from a main FIFO.

    New keys enter the small queue S, sized to 10% of the capacity in bytes, unless the ghost
    queue G remembers them as recently evicted from S: those go straight to the main queue M.
    Each hit adds one to a key's frequency, capped at 3. Eviction takes from S while S holds at
    least its 10% share (or M is empty): S's oldest key moves to M if it was hit, else it is the
    victim and its key enters G. Otherwise M's oldest key is reinserted at M's newest end with
    one frequency spent if it was hit, else it is the victim.

    G holds keys only, at most as many as the most keys this policy has held at once. The paper
    sizes G to M's capacity in objects; a byte-capacity cache has no object capacity, and the
    high-water mark is the object count it has shown it can hold. Bounding G by M's current
    length instead would leave G empty while a cold cache evicts only from S (M still empty),
    which is exactly when a ghost hit matters, and would flush G whenever the cache shrinks.
    """

    name = "s3fifo"
    small_fraction = 0.10
    max_frequency = 3

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.small_target_bytes = int(capacity_bytes * self.small_fraction)
        # Queues map key -> size in bytes, oldest first.
        self._small: OrderedDict[K, int] = OrderedDict()
        self._main: OrderedDict[K, int] = OrderedDict()
        self._ghost: OrderedDict[K, None] = OrderedDict()
        self._frequency: dict[K, int] = {}
        self._small_bytes = 0
        self._main_bytes = 0
        # Most keys held at once: the ghost queue's bound (see the class docstring).
        self._peak_keys = 0

    @property
    def small_bytes(self) -> int:
        return self._small_bytes

    @property
    def main_bytes(self) -> int:
        return self._main_bytes

    def insert(self, key: K, size: int) -> None:
        _check_size(size)
        self.remove(key)
        if key in self._ghost:
            # Evicted from S recently and wanted again: it has proven reuse, skip the filter.
            del self._ghost[key]
            self._main[key] = size
            self._main_bytes += size
        else:
            self._small[key] = size
            self._small_bytes += size
        self._frequency[key] = 0
        self._peak_keys = max(self._peak_keys, len(self._frequency))

    def touch(self, key: K) -> None:
        frequency = self._frequency.get(key)
        if frequency is not None and frequency < self.max_frequency:
            self._frequency[key] = frequency + 1

    def remove(self, key: K) -> None:
        if self._frequency.pop(key, None) is None:
            return
        if key in self._small:
            self._small_bytes -= self._small.pop(key)
        else:
            self._main_bytes -= self._main.pop(key)

    def _remember_in_ghost(self, key: K) -> None:
        self._ghost[key] = None
        if len(self._ghost) > self._peak_keys:
            self._ghost.popitem(last=False)

    def victim(self, evictable: Callable[[K], bool] | None = None) -> K | None:
        # A key found non-evictable is rotated to its queue's newest end so the scan can pass
        # it, and counted; a queue whose every key was found non-evictable is closed for this
        # call. S receives no keys during a call, so its count stays exact; in M, keys passed
        # before are rotated again without a second evictable() call. The loop ends: each
        # step either returns, moves a key from S to M, spends one of M's bounded frequencies,
        # or finds a new non-evictable key, with at most one re-rotation per skipped key between.
        skipped: set[K] = set()
        skipped_in_small = 0
        skipped_in_main = 0
        while True:
            small_open = skipped_in_small < len(self._small)
            main_open = skipped_in_main < len(self._main)
            if small_open and (self._small_bytes >= self.small_target_bytes or not main_open):
                key = next(iter(self._small))
                if evictable is not None and not evictable(key):
                    self._small.move_to_end(key)
                    skipped.add(key)
                    skipped_in_small += 1
                    continue
                size = self._small.pop(key)
                self._small_bytes -= size
                if self._frequency[key] >= 1:
                    # Hit while in S: not a one-hit wonder, promote with a fresh count.
                    self._main[key] = size
                    self._main_bytes += size
                    self._frequency[key] = 0
                    continue
                del self._frequency[key]
                self._remember_in_ghost(key)
                return key
            if main_open:
                key = next(iter(self._main))
                if key in skipped:
                    self._main.move_to_end(key)
                    continue
                if evictable is not None and not evictable(key):
                    self._main.move_to_end(key)
                    skipped.add(key)
                    skipped_in_main += 1
                    continue
                frequency = self._frequency[key]
                if frequency > 0:
                    # Lazy promotion: a hit key gets another lap, spending one of its hits.
                    self._main.move_to_end(key)
                    self._frequency[key] = frequency - 1
                    continue
                self._main_bytes -= self._main.pop(key)
                del self._frequency[key]
                return key
            return None

    def in_small(self, key: object) -> bool:
        """Whether ``key`` is in the small queue (tests and diagnostics)."""
        return key in self._small

    def in_main(self, key: object) -> bool:
        """Whether ``key`` is in the main queue (tests and diagnostics)."""
        return key in self._main

    def in_ghost(self, key: object) -> bool:
        """Whether ``key`` is remembered by the ghost queue (tests and diagnostics)."""
        return key in self._ghost

    def __len__(self) -> int:
        return len(self._frequency)

    def __contains__(self, key: object) -> bool:
        return key in self._frequency

    def keys_in_eviction_order(self) -> list[K]:
        """The order successive ``victim()`` calls would return, found by running them on a copy.

        Exact for back-to-back ``victim()`` calls with nothing evictable-filtered; any insert,
        touch or remove in between changes it, so treat it as a snapshot.
        """
        copy: S3FIFOPolicy[K] = S3FIFOPolicy(self.capacity_bytes)
        copy._small = OrderedDict(self._small)
        copy._main = OrderedDict(self._main)
        copy._ghost = OrderedDict(self._ghost)
        copy._frequency = dict(self._frequency)
        copy._small_bytes = self._small_bytes
        copy._main_bytes = self._main_bytes
        copy._peak_keys = self._peak_keys
        order: list[K] = []
        while (key := copy.victim()) is not None:
            order.append(key)
        return order

    def __repr__(self) -> str:
        return (
            f"<S3FIFOPolicy small={len(self._small)}/{self._small_bytes}B "
            f"main={len(self._main)}/{self._main_bytes}B ghost={len(self._ghost)}>"
        )


POLICY_NAMES: tuple[str, ...] = ("lru", "lfu", "fifo", "mru", "s3fifo")


def make_policy(name: str, capacity_bytes: int) -> EvictionPolicy[Any]:
    """Build the policy called ``name`` (case-insensitive) for a cache of ``capacity_bytes``."""
    normalized = name.strip().lower()
    if capacity_bytes < 0:
        raise ConfigError(f"eviction capacity_bytes must be >= 0, got {capacity_bytes}")
    if normalized == "lru":
        return LRUPolicy()
    if normalized == "lfu":
        return LFUPolicy()
    if normalized == "fifo":
        return FIFOPolicy()
    if normalized == "mru":
        return MRUPolicy()
    if normalized == "s3fifo":
        return S3FIFOPolicy(capacity_bytes)
    raise ConfigError(
        f"unknown eviction policy {name!r}; valid policies: {', '.join(POLICY_NAMES)}"
    )
