"""Store: put/get/lookup/prefetch/flush across the ordered tier list.

- put: copy the object once into a pool slab, index it in L1 (when the first tier is a bare
  ``memory://``), queue frame writes to every lower tier, return. A durable put (``durable=True``
  or ``write_policy: through``) writes the lower tiers itself instead, and returns once they
  hold the object. When the pool cannot hold the object (larger than the pool, or full of
  in-flight data past the wait), the put writes the lower tiers itself from the caller's memory:
  memory stays bounded either way.
- get: L1, then writes still in flight, then each lower tier in order; the first hit is
  verified, decoded into a slab and promoted into L1. Concurrent gets of one key share one
  fetch. A failing tier is a miss for the caller and a counted error for the operator.
- Objects returned by ``get`` share memory with the cache (no copy): treat them as read-only.
  (Writing into one whose write-back to a lower tier is still queued makes that tier's copy
  fail its checksum, hashed when the object was put: a counted miss later, never a wrong
  object.)
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from typing import Any, Self, TypeVar
from urllib.parse import urlsplit

import numpy as np
import xxhash

from gateway.config import DEFAULT_EVICTION, StoreConfig, TierConfig, load_config
from gateway.connector import Connector, writing_durably
from gateway.errors import (
    CapacityError,
    ConfigError,
    GatewayError,
    IncompleteDelete,
    InvalidObject,
    NotFound,
    Unavailable,
)
from gateway.inflight import InFlight
from gateway.jobs import Hold, TierWriter, WriteJob
from gateway.keys import Key, normalize_key
from gateway.layers import build_stack
from gateway.memory import BufferPool, Slab
from gateway.object_meta import check_position, check_ttl
from gateway.objects import COPIED_KINDS, ObjectData, ObjectMeta, to_object, to_object_data
from gateway.policies import make_policy
from gateway.registry import build_codec, connect, connector_class, scheme_of
from gateway.tiers import ConnectorTier, Found, MemoryTier, offload
from gateway.types import MemoryFormat, TierStats

log = logging.getLogger("kvgate.store")
T = TypeVar("T")

DEFAULT_L1_CAPACITY = 2 << 30
ALLOC_WAIT_POLL = 0.05  # seconds between re-tries while waiting for pool space
# Reads of ``stat`` (HTTP HEAD) running at once: each may hold a whole object outside the pool.
STAT_READS = 2
# lookup asks a lower tier about LOOKUP_WINDOW keys first, then (a tier without batch
# existence checks) windows LOOKUP_GROWTH times larger: see Store._leading_run.
LOOKUP_WINDOW = 64
LOOKUP_GROWTH = 4
STAGING = "staging"  # lookup_detail's name for objects held in the pool of a store without L1
# Why a ``skip`` tier's writes are bounded in bytes too, not only by ``queue_size``: a queue of
# 64 jobs of 1 MiB pins more than a 64 MiB memory tier, and an L1 entry whose write is queued
# cannot be evicted. With Redis stalled, every slab ended up pinned, puts found no room, went
# to the stalled tier directly and failed after its timeout, and not one write was skipped. So
# the unfinished writes of a skip tier may pin at most this share of the pool (the rest keeps
# serving recent puts), and a put that still finds no room drops queued writes of skip tiers,
# oldest first, to free their slabs (``Store._alloc``). A share of the whole pool rather than
# one per tier: the writes of one put share its slab, so tiers that stall together pin the
# same slabs.
SKIP_PIN_SHARE = 0.5

KeyLike = Key | str
ConfigSource = StoreConfig | Mapping[str, Any] | str | os.PathLike[str] | None


class _Fetch:
    """One in-flight fetch of a key, shared by every get that asks while it runs."""

    __slots__ = ("future", "stale")

    def __init__(self, future: asyncio.Future[Found | None]) -> None:
        self.future = future  # the fetch's outcome, for the gets that wait for it
        self.stale = False  # a put or delete came after it started: do not promote


class _Abandoned(Exception):
    """The get that ran a fetch was cancelled before it ended: the waiting gets fetch again."""


class Store:
    """The tiered KV-cache store. Cheap to build; opened by ``async with`` or ``open()``."""

    def __init__(
        self, config: ConfigSource = None, *, connectors: Mapping[int, Connector] | None = None
    ) -> None:
        """``connectors`` replaces the connector of tier ``i`` (e.g. one a test already built)."""
        self.config = load_config(config)
        self._given = dict(connectors or {})
        self.l1: MemoryTier | None = None
        self.tiers: list[ConnectorTier] = []
        self.writers: list[TierWriter] = []
        self.pool: BufferPool | None = None
        self._fetching: dict[str, _Fetch] = {}
        self._in_flight = InFlight()  # puts and deletes in progress; close() waits for them
        # Puts holding a slab they have not handed to the memory tier or the queues yet: a put
        # that finds the pool full waits for them rather than failing (they end soon, and the
        # memory tier can then evict what they put).
        self._filling = 0
        self._stat_reads = asyncio.Semaphore(STAT_READS)
        self._background: set[asyncio.Task[Any]] = set()
        self._space = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None  # the ident of the thread that runs it
        self._opened = False
        self._closed = False
        self._open_lock = asyncio.Lock()
        self._l1_ttl: float | None = None
        # A raw frame's checksum is the object's hash: computed while put copies the object
        # when some lower tier writes raw frames, and not at all for a memory-only store.
        self._hash_on_copy = False

    # -- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def open(self) -> None:
        async with self._open_lock:
            if self._opened:
                return
            if self._closed:
                raise Unavailable("store is closed")
            await self._build()
            self._opened = True

    async def _build(self) -> None:
        cfg = self.config
        tiers = list(cfg.tiers)
        names = _tier_names(tiers)
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        first_is_l1 = bool(tiers) and is_l1_url(tiers[0].url)
        if first_is_l1 and 0 not in self._given:
            l1_cfg = tiers[0]
            if l1_cfg.options:
                raise ConfigError("the memory:// L1 tier takes no connector options")
            capacity = l1_cfg.capacity if l1_cfg.capacity is not None else DEFAULT_L1_CAPACITY
            self.pool = await self._new_pool(capacity)
            policy = make_policy(l1_cfg.eviction, capacity)
            self.l1 = MemoryTier(names[0], self.pool, policy)
            self._l1_ttl = l1_cfg.ttl
            lower = list(enumerate(tiers))[1:]
        else:
            self.pool = await self._new_pool(cfg.staging)
            lower = list(enumerate(tiers))
        # Weakly: an object a caller still holds keeps the pool alive, and a strong callback
        # would keep the whole closed Store (its tiers, connectors and threads' state) with it.
        self.pool.on_free.append(_weak_call(weakref.WeakMethod(self._on_pool_free)))
        try:
            for i, tcfg in lower:
                tier = self._build_tier(i, names[i], tcfg)
                self.tiers.append(tier)
                writer = TierWriter(
                    tier,
                    queue_size=tcfg.queue_size,
                    workers=tcfg.workers,
                    backpressure=tcfg.backpressure,
                    pin_limit=int(self.pool.capacity * SKIP_PIN_SHARE),
                )
                writer.start()
                self.writers.append(writer)
            self._hash_on_copy = any(t.codec.name == "raw" for t in self.tiers)
        except BaseException:
            await self._close_tiers()
            raise

    async def _new_pool(self, capacity: int) -> BufferPool:
        cfg = self.config
        huge = cfg.pool_in_huge_pages()
        if cfg.prefault:  # populating takes ~1 s per GiB: not on the event loop
            # Returned in a box that is emptied: the thread's futures end up in a reference
            # cycle, and holding the pool as their result would keep its memory until the next
            # cyclic collection (256 MiB per closed Store in a bench loop, measured).
            box = await asyncio.to_thread(
                lambda: [BufferPool(capacity, pin=cfg.pin_memory, prefault=True, huge_pages=huge)]
            )
            return box.pop()
        return BufferPool(capacity, pin=cfg.pin_memory, huge_pages=huge)

    def _build_tier(self, index: int, name: str, tcfg: TierConfig) -> ConnectorTier:
        conn = self._given.get(index)
        if conn is None:
            options = dict(tcfg.options)
            if tcfg.capacity is not None:
                options["capacity"] = tcfg.capacity
            if tcfg.eviction != DEFAULT_EVICTION:  # another policy: the connector must take it
                # The default is not passed: a connector that is bounded but does not evict
                # (sqlite refuses puts when full) would refuse an option nobody wrote, and a
                # dumped config writes the default out (evicting connectors default to it).
                options["eviction"] = tcfg.eviction
            with _naming_tier(name):
                conn = connect(tcfg.url, **options)
        stats = TierStats(name)
        stacked = build_stack(
            conn,
            timeout=tcfg.timeout,
            retry=(tcfg.retry.attempts, tcfg.retry.backoff_base, tcfg.retry.backoff_max),
            breaker=(tcfg.breaker.failures, tcfg.breaker.reset_after),
            concurrency=tcfg.concurrency,
            stats=stats,
        )
        with _naming_tier(name):
            codec = build_codec(tcfg.codec, tcfg.codec_options)
        self._start_early(name, conn)
        return ConnectorTier(name, stacked, codec, stats, ttl=tcfg.ttl)

    def _start_early(self, name: str, conn: Connector) -> None:
        """Begin a connector's own start-up (its ``open()``, if it has one) as the store opens,
        not at the first request: the disk tier reads its saved index (5 s at 1M objects) or
        scans every record (over a minute), and calls meanwhile are misses."""
        start = getattr(conn, "open", None)
        if not inspect.iscoroutinefunction(start):
            return

        async def run() -> None:
            try:
                await start()
            except Exception as exc:  # the next call starts it again, and reports
                log.warning("tier %s: start-up failed: %s", name, exc)

        self._spawn(run(), f"kvgate-start-{name}")

    def _spawn(self, work: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        """A background task of this store's: close() cancels and awaits it."""
        task = asyncio.create_task(work, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def flush(self) -> None:
        """Wait until every write accepted so far has reached (or failed at) its tier."""
        await asyncio.gather(*(w.drain() for w in self.writers))

    async def close(self) -> None:
        """Drain every queue, stop workers and background work, close connectors."""
        if self._closed:
            return
        self._closed = True
        if not self._opened:
            return
        await self._in_flight.wait_idle()  # accepted puts finish queueing their writes
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await asyncio.gather(*(w.close() for w in self.writers), return_exceptions=True)
        await self._close_tiers()

    async def _close_tiers(self) -> None:
        for tier in self.tiers:
            try:
                await tier.connector.close()
            except Exception as exc:
                log.warning("tier %s: close failed: %s", tier.name, exc)

    async def _operation(self) -> InFlight:
        """``with await self._operation():`` around a put or delete: refused once closing
        began, and waited for by close(). (Not an async context manager: entering and leaving
        one costs two coroutines on every put.)"""
        await self._ready()
        return self._in_flight.track()

    async def _ready(self) -> None:
        if self._closed:
            raise Unavailable("store is closed")
        if not self._opened:
            await self.open()

    # -- memory ----------------------------------------------------------------------------

    def _on_pool_free(self) -> None:
        if threading.get_ident() == self._loop_thread:
            # Freed on the loop (a tier's write finished): no wake-up through the loop's
            # self-pipe, a system call and an extra loop pass on every put.
            self._space.set()
            return
        loop = self._loop
        if loop is not None and not loop.is_closed():
            # RuntimeError: the loop closed between the check and the call.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._space.set)

    def _alloc_now(self, nbytes: int) -> Slab | None:
        if self.l1 is not None:
            return self.l1.alloc(nbytes)
        assert self.pool is not None
        return self.pool.alloc(nbytes)

    def _waited_writes_in_flight(self) -> bool:
        """Whether a ``wait`` tier has unfinished writes (that will free pool space)."""
        return any(w.in_flight for w in self.writers if w.backpressure == "wait")

    def _skip_queued_write(self) -> bool:
        """Drop queued writes of ``skip`` tiers, oldest first, for one put whose slab that
        frees (or leaves to the memory tier alone, which can evict it); False when no such put
        is queued. A slab that a ``wait`` tier's write, a running write or a reader still holds
        would not be freed: the skip tiers' writes of it are kept."""
        skipping = [w for w in self.writers if w.can_skip()]
        for writer in skipping:
            for job in list(writer.queued.values()):
                holders = [w for w in skipping if w.queued.get(job.slab) is not None]
                cached = self.l1 is not None and self.l1.holds(job.key, job.slab)
                if job.slab.refs - len(holders) > (1 if cached else 0):
                    continue  # something else keeps the slab: dropping frees nothing
                for other in holders:
                    other.skip_queued(job.slab)
                return True
        return False

    def reserve(self, nbytes: int) -> Slab | None:
        """Pool memory for an object the caller is about to receive and ``put``: fill
        ``slab.view()``, then ``put(key, obj, staged=slab)`` with ``obj`` over that memory, and
        release the slab after the put (or if none follows). The put then keeps the slab, not
        a copy of it: a server that receives into it saves a copy of every object. None when
        the store has no pool or the pool cannot give it now, without waiting (the memory tier
        may evict to make room); the caller then receives into its own buffer and puts that."""
        if self.pool is None or not 0 < nbytes <= self.pool.capacity:
            return None
        return self._alloc_now(nbytes)

    async def _alloc(self, nbytes: int) -> Slab | None:
        """A slab. When the pool is full: first drop queued writes of ``skip`` tiers (see
        SKIP_PIN_SHARE), then wait (bounded) for writes of ``wait`` tiers to free space."""
        assert self.pool is not None
        if nbytes > self.pool.capacity:
            return None
        deadline = asyncio.get_running_loop().time() + max(
            (t.timeout for t in self.config.tiers), default=5.0
        )
        while True:
            slab = self._alloc_now(nbytes)
            if slab is not None:
                return slab
            if self._skip_queued_write():
                continue
            if not self._waited_writes_in_flight() and not self._filling:
                return None  # nothing under way will free or release memory
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return None
            self._space.clear()
            try:
                async with asyncio.timeout(min(remaining, ALLOC_WAIT_POLL)):
                    await self._space.wait()
            except TimeoutError:
                pass

    # -- put -------------------------------------------------------------------------------

    async def put(
        self,
        key: KeyLike,
        obj: object,
        *,
        fmt: int = MemoryFormat.UNDEFINED,
        ttl: float | None = None,
        durable: bool = False,
        position: int | None = None,
        staged: Slab | None = None,
    ) -> None:
        """Store ``obj`` under ``key`` in every tier.

        ``staged``: a slab from ``reserve`` that ``obj``'s bytes already fill (``obj`` is a
        view of ``staged.view()``). The store keeps that memory instead of copying ``obj``;
        the caller must not write to it once the put has started, nor stage it again.

        ``position``: where the object (a KV chunk) starts in its token sequence, when known.
        It is not stored as such; codecs that use it record what they need in their frames
        (``kvtc`` undoes RoPE on keys with it, and keeps the sequence's first tokens exact).

        Write-back (the default): returns once the first tier holds the object; the lower tiers
        are written from bounded queues afterwards (``flush`` waits for them). Durable
        (``durable=True``, or every put under ``write_policy: through``): returns once every
        lower tier holds the object, and otherwise raises the error of the first tier that
        failed (the tiers that took it keep it; the others are never read for the key until a
        later write of it succeeds). A durable put is never skipped by back-pressure. A tier
        where a newer put or delete of the key superseded the durable write before it ran is
        not written and is not a failure: the newer operation decides what that tier holds.
        """
        k = normalize_key(key)
        durable = durable or self.config.write_policy == "through"
        data = to_object_data(obj, fmt)
        if staged is not None:
            _check_staged(staged, data)
        data.position = check_position(position)
        ttl = check_ttl(ttl)
        nbytes = data.meta.nbytes
        if nbytes > self.config.max_object_size:
            raise CapacityError(
                f"object of {nbytes} bytes exceeds max_object_size ({self.config.max_object_size})"
            )
        with await self._operation():
            # An explicit ttl applies everywhere; otherwise each tier uses its own default.
            expires_at = _expiry(ttl, None)
            if durable and self.l1 is None and self.tiers and data.host_ready:
                # Nothing to stage: the caller's memory outlives a put that returns only once
                # every tier holds the object, so the tiers are written from it (no copy).
                await self._put_from_caller(k, data, expires_at)
                return
            slab = staged.acquire() if staged is not None else await self._alloc(nbytes)
            if slab is None:
                await self._put_direct(k, data, expires_at, durable=durable)
                return
            self._filling += 1
            try:  # the put's own slab reference, released below whatever happens
                # offload copies on the loop below OFFLOAD_BYTES even while lower tiers' writes
                # keep the loop busy: 1 MiB puts into Redis or memory + disk took 0.1-0.4 ms
                # less CPU each that way than with the copy in a thread, and no more loop CPU
                # (the thread's round trip and wake-ups cost what the copy did).
                device = not data.on_host
                if staged is not None:  # the bytes are in the slab already: no copy
                    if self._hash_on_copy:
                        data.checksum = await offload(nbytes, xxhash.xxh3_64_intdigest, slab.view())
                elif self._hash_on_copy:
                    data.checksum = await offload(
                        nbytes, data.copy_hashed, slab.view(), device=device
                    )
                else:
                    await offload(nbytes, data.copy_into, slab.view(), device=device)
                self._invalidate_fetch(k)
                if self.l1 is not None:  # first, so that a get during the queue waits sees it
                    l1_expires = _expiry(ttl, self._l1_ttl)
                    self.l1.insert(k, data.meta, slab.acquire(), expires_at=l1_expires)
                if durable:  # written from the slab, which the put holds until it returns
                    from_slab = ObjectData(
                        data.meta, slab.view(), checksum=data.checksum, position=data.position
                    )
                    await self._write_tiers(k, from_slab, expires_at, durable=True)
                else:
                    await self._queue_writes(k, data, slab, expires_at)
            finally:
                slab.release()
                self._filling -= 1
                self._space.set()  # its slab is the memory tier's now, which can evict it

    async def _queue_writes(
        self, key: str, data: ObjectData, slab: Slab, expires_at: float | None
    ) -> None:
        jobs = [
            WriteJob(key, data.meta, slab.acquire(), expires_at, data.checksum, data.position)
            for _ in self.writers
        ]
        for writer, job in zip(self.writers, jobs, strict=True):
            writer.register(job)  # every tier, before the first await
        queued = 0
        try:
            for writer, job in zip(self.writers, jobs, strict=True):
                await writer.enqueue(job)
                queued += 1
        finally:
            pairs = list(zip(self.writers, jobs, strict=True))[queued + 1 :]
            for writer, job in pairs:  # cancelled: these were never queued
                writer.abandon(job)

    async def _put_from_caller(self, key: str, data: ObjectData, expires_at: float | None) -> None:
        """A durable put without a memory tier: every tier written from the caller's bytes,
        hashed once here when more than one tier frames them raw (each would hash them)."""
        raw_tiers = sum(t.codec.name == "raw" for t in self.tiers)
        if raw_tiers > 1:
            data.checksum = await offload(data.meta.nbytes, xxhash.xxh3_64_intdigest, data.host())
        await self._put_direct(key, data, expires_at, durable=True)

    async def _put_direct(
        self, key: str, data: ObjectData, expires_at: float | None, *, durable: bool
    ) -> None:
        """Write every lower tier from the caller's memory (object too big for the pool)."""
        if not self.tiers:
            assert self.pool is not None
            raise CapacityError(
                f"object of {data.meta.nbytes} bytes does not fit the memory tier "
                f"({self.pool.capacity} bytes) and there is no lower tier"
            )
        self._invalidate_fetch(key)
        if self.l1 is not None:
            self.l1.remove(key)  # an older version must not shadow this one
        await self._write_tiers(key, data, expires_at, durable=durable)

    async def _write_tiers(
        self, key: str, data: ObjectData, expires_at: float | None, *, durable: bool
    ) -> None:
        """Write ``data`` to every lower tier now, in order with the key's queued writes.

        Raises the first failing tier's error when ``durable``; otherwise only when no tier
        took the object (a put too big for the pool then has nowhere to be). Not durable, a
        ``skip`` tier that is behind (``TierWriter.behind``) is written only if none of the
        others took the object: a put must not wait for a stalled tier it may skip, nor lose
        an object that tier could have held.
        """
        marks = [w.hold(key) for w in self.writers]  # every tier, before the first await
        ttl = None if expires_at is None else max(expires_at - time.time(), 0.001)

        async def write(writer: TierWriter, mark: Hold) -> GatewayError | None:
            ok = False
            try:
                if not await writer.acquire(key, mark):
                    return None  # a newer put or delete of the key superseded this one
                error = await writer.write_now(key, data, ttl)
                ok = error is None
                return error
            finally:
                writer.release(key, mark, ok)

        async def write_all(pairs: list[tuple[TierWriter, Hold]]) -> list[GatewayError | None]:
            if len(pairs) == 1:  # no task to start and wait for
                return [await write(*pairs[0])]
            return list(await asyncio.gather(*(write(w, m) for w, m in pairs)))

        pairs = list(zip(self.writers, marks, strict=True))
        later = [] if durable else [(w, m) for w, m in pairs if w.can_skip() and w.behind()]
        first = [pair for pair in pairs if pair not in later]
        try:
            with writing_durably(durable):  # a gateway:// tier asks its remote to write through
                errors = await write_all(first) if first else []
                failed = [e for e in errors if e is not None]
                if later and len(failed) == len(first):  # nothing took it: try them after all
                    errors += await write_all(later)
                else:
                    for writer, _ in later:  # skipped: the hold marked the key stale there
                        writer.tier.stats.skipped_writes += 1
        finally:  # children cancelled before they ran never reached their own release
            for writer, mark in pairs:
                writer.release(key, mark, False)
        failed = [e for e in errors if e is not None]
        if failed and (durable or len(failed) == len(errors)):
            raise failed[0]

    async def put_many(
        self,
        items: Iterable[tuple[KeyLike, object]],
        *,
        fmt: int = MemoryFormat.UNDEFINED,
        durable: bool = False,
        positions: Iterable[int | None] | None = None,
    ) -> None:
        """``put`` of each item in turn, all in memory format ``fmt``; durable: each returns
        once every tier holds it. ``positions``: each item's start in its token sequence (see
        ``put``), one per item."""
        listed = list(items)
        starts: list[int | None] = [None] * len(listed) if positions is None else list(positions)
        if len(listed) != len(starts):
            raise InvalidObject(f"{len(listed)} items but {len(starts)} positions")
        for (key, obj), position in zip(listed, starts, strict=True):
            await self.put(key, obj, fmt=fmt, durable=durable, position=position)

    # -- get -------------------------------------------------------------------------------

    async def get(self, key: KeyLike) -> object | None:
        """The object stored under ``key`` (same kind as put), or None on a miss."""
        found = await self.get_with_meta(key)
        return None if found is None else found[0]

    async def get_with_meta(self, key: KeyLike) -> tuple[object, ObjectMeta] | None:
        """Like ``get``, with the stored metadata (kind, dtype, shape, memory format): what a
        protocol that echoes the memory format (lm://, the HTTP headers) must answer with."""
        k = normalize_key(key)
        await self._ready()
        if self.l1 is not None:
            entry = self.l1.lookup(k)
            if entry is not None:
                meta = entry.meta
                if meta.kind in COPIED_KINDS:  # a copy: no lease to keep
                    view = entry.slab.view(entry.offset, meta.nbytes)
                    return await offload(meta.nbytes, to_object, meta, view), meta
                return to_object(meta, entry.lease()), meta
        found = await self._fetch_shared(k)
        if found is None:
            return None
        if not found.copies():  # a lease on the slab: no bytes move, no thread needed
            return found.to_object(), found.meta
        return await offload(found.meta.nbytes, found.to_object), found.meta

    async def get_stored(self, key: KeyLike) -> ObjectData | None:
        """The bytes stored under ``key`` with their metadata, for a protocol that sends bytes
        (lm://, HTTP): a lease on the memory tier's copy, never a copy and never the user's
        kind of object (building a tensor only to take its bytes again cost ~0.1 ms a get)."""
        k = normalize_key(key)
        await self._ready()
        if self.l1 is not None:
            entry = self.l1.lookup(k)
            if entry is not None:
                return ObjectData(entry.meta, entry.lease())
        found = await self._fetch_shared(k)
        return None if found is None else ObjectData(found.meta, found.stored_bytes())

    async def stat(self, key: KeyLike) -> ObjectMeta | None:
        """The stored metadata of ``key`` (what a HEAD answers), or None on a miss.

        The memory tier answers from its entry. Otherwise the object is read from a lower tier
        (a tier cannot read a frame's header alone) into free pool memory, or memory of its
        own when the pool has none free, and is not promoted: asking evicts nothing. A fetch
        of the key already under way is waited for, and later gets and stats of the key wait
        for this one; at most ``STAT_READS`` such reads run at once.
        """
        k = normalize_key(key)
        await self._ready()
        if self.l1 is not None:
            entry = self.l1.lookup(k)
            if entry is not None:
                return entry.meta
        found = await self._fetch_shared(k, reading=self._stat_reads)
        return None if found is None else found.meta

    def _free_pool_only(self, nbytes: int) -> Slab | None:
        """Pool memory that is free now, evicting nothing (``stat``'s reads)."""
        return None if self.pool is None else self.pool.alloc(nbytes)

    def stored_in_memory(self, key: KeyLike) -> ObjectData | None:
        """What ``get_stored`` answers when the memory tier holds ``key`` (a lease on its
        copy), else None, without awaiting: for a server answering from a protocol callback.
        None too before the store is open, after it closed, and without a memory tier. A hit
        counts in the memory tier's stats; a None counts nothing, since the caller then asks
        ``get_stored``, which counts the miss."""
        if self.l1 is None or not self._opened or self._closed:
            return None
        k = normalize_key(key)
        if k not in self.l1:
            return None
        entry = self.l1.lookup(k)
        if entry is None:
            return None
        return ObjectData(entry.meta, entry.lease())

    async def get_many(self, keys: Sequence[KeyLike]) -> list[object | None]:
        return list(await asyncio.gather(*(self.get(k) for k in keys)))

    async def _fetch_shared(
        self, key: str, *, reading: asyncio.Semaphore | None = None
    ) -> Found | None:
        """Fetch ``key`` from the lower tiers, once for all the gets that ask meanwhile.

        The first get runs the fetch itself, in its own task: a task per fetch and the shield
        that kept a caller's cancel from reaching it cost about 11 us of loop CPU per get. The
        gets that come while it runs wait for its outcome; if that first get is cancelled, its
        fetch stops and a waiting get fetches again (``_Abandoned``), so a cancel ends only
        the work of the get that was cancelled.

        ``reading``: ``stat``'s bound on its own reads, which go to free pool memory only and
        are not promoted (a fetch already under way is joined as it is).
        """
        while True:
            state = self._fetching.get(key)
            if state is None:
                if reading is None:
                    return await self._fetch_first(key)
                async with reading:
                    if key not in self._fetching:  # none started while this one waited
                        return await self._fetch_first(
                            key, promote=False, alloc=self._free_pool_only
                        )
                continue
            try:
                return await asyncio.shield(state.future)
            except _Abandoned:
                continue

    async def _fetch_first(
        self, key: str, *, promote: bool = True, alloc: Callable[[int], Slab | None] | None = None
    ) -> Found | None:
        state = _Fetch(asyncio.get_running_loop().create_future())
        state.stale = not promote
        self._fetching[key] = state
        try:
            found = await self._fetch(key, state, alloc)
        except BaseException as exc:
            # Waiting gets see the failure, or, for a cancel, fetch again. Marked retrieved
            # at once: there may be no waiting get to retrieve it.
            cancelled = isinstance(exc, asyncio.CancelledError)
            state.future.set_exception(_Abandoned() if cancelled else exc)
            state.future.exception()
            raise
        finally:
            self._fetch_done(key, state)
        state.future.set_result(found)
        return found

    def _fetch_done(self, key: str, state: _Fetch) -> None:
        if self._fetching.get(key) is state:
            del self._fetching[key]

    def _invalidate_fetch(self, key: str) -> None:
        """A put or delete of ``key`` while it is being fetched: that fetch still answers the
        gets that asked before, but later gets start a new one and it is not promoted."""
        state = self._fetching.pop(key, None)
        if state is not None:
            state.stale = True

    async def _fetch(
        self, key: str, state: _Fetch, alloc: Callable[[int], Slab | None] | None = None
    ) -> Found | None:
        """``key`` from the first lower tier that holds it (or a queued write), promoted into
        the memory tier unless ``state`` is stale. ``alloc``: where a tier reads to, the pool by
        default."""
        for writer in self.writers:  # read your own writes while they are still queued
            job = writer.pending(key)
            if job is not None:
                queued = Found(job.meta, slab=job.slab.acquire(), expires_at=job.expires_at)
                self._promote(key, queued, state)
                return queued
        for writer, tier in zip(self.writers, self.tiers, strict=True):
            if key in writer.stale:  # this tier may hold an older version: not served
                continue
            try:
                found = await tier.read(key, alloc or self._alloc_now, self.config.max_object_size)
            except GatewayError as exc:  # counted by the metrics layer; a miss for the caller
                log.debug("tier %s: get failed (%s): %s", tier.name, exc.kind, exc)
                continue
            except Exception:
                tier.stats.count_error("internal")
                log.exception("tier %s: get failed", tier.name)
                continue
            if found is not None:
                self._promote(key, found, state)
                return found
        return None

    def _promote(self, key: str, found: Found, state: _Fetch) -> None:
        if state.stale:
            return
        if self.l1 is not None and found.slab is not None and key not in self.l1:
            slab = found.slab.acquire()
            self.l1.insert(key, found.meta, slab, found.offset, found.expires_at)

    # -- contains / delete / lookup / prefetch -------------------------------------------

    async def contains(self, key: KeyLike) -> bool:
        k = normalize_key(key)
        return (await self.lookup([k])) == 1

    async def delete(self, key: KeyLike) -> bool:
        """Remove ``key`` from every tier; True when any tier held it.

        Every tier is tried; if any failed, ``IncompleteDelete`` is raised after the others
        were tried, naming the first failure (its cause). A tier whose delete failed is not read
        for the key (it may still hold it) until a later write or delete of it succeeds, and a
        clean ``close`` deletes it there again (``TierWriter.scrub``), so that a store opened
        later does not serve it.
        """
        k = normalize_key(key)
        with await self._operation():
            self._invalidate_fetch(k)
            removed = any(w.pending(k) is not None for w in self.writers)
            marks = [w.hold(k) for w in self.writers]  # every tier, before the first await
            removed = (self.l1.remove(k) if self.l1 is not None else False) or removed
            failed: tuple[str, GatewayError] | None = None
            try:
                for writer, mark in zip(self.writers, marks, strict=True):
                    ok = False
                    try:
                        if not await writer.acquire(k, mark):
                            continue  # a newer put of the key superseded this delete
                        removed = await writer.tier.delete(k) or removed
                        ok = True
                    except GatewayError as exc:
                        log.warning(
                            "tier %s: delete failed (%s): %s", writer.tier.name, exc.kind, exc
                        )
                        failed = failed or (writer.tier.name, exc)
                    finally:
                        writer.release(k, mark, ok)
            finally:  # cancelled or failed midway: the later tiers' holds end too
                for writer, mark in zip(self.writers, marks, strict=True):
                    writer.release(k, mark, False)
            if failed is not None:
                name, cause = failed
                raise IncompleteDelete(
                    f"{k!r} may still be in tier {name}: its delete failed ({cause.kind}): {cause}"
                ) from cause
            return removed

    async def lookup(self, keys: Sequence[KeyLike]) -> int:
        """How many leading ``keys`` are stored, continuing the prefix from tier to tier.

        Lower tiers answer from existence checks, so an object whose TTL ran out there still
        counts until a get reads it (and drops it); a get can always miss after a lookup.
        """
        return sum(n for _, n in await self.lookup_detail(keys))

    async def lookup_detail(self, keys: Sequence[KeyLike]) -> list[tuple[str, int]]:
        """Per tier, in order: how many further leading keys that tier holds. Without a
        memory tier, objects still in the staging pool (their writes queued) come first, as
        ``STAGING``."""
        ks = [normalize_key(k) for k in keys]
        await self._ready()
        detail: list[tuple[str, int]] = []
        n = 0
        if self.l1 is not None:
            while n < len(ks) and (ks[n] in self.l1 or self._pending(ks[n])):
                n += 1
            detail.append((self.l1.name, n))
        else:
            while n < len(ks) and self._pending(ks[n]):
                n += 1
            detail.append((STAGING, n))
        for writer, tier in zip(self.writers, self.tiers, strict=True):
            if n == len(ks):
                detail.append((tier.name, 0))
                continue
            run = await self._leading_run(writer, tier, ks[n:])
            detail.append((tier.name, run))
            n += run
        return detail

    async def _leading_run(self, writer: TierWriter, tier: ConnectorTier, keys: list[str]) -> int:
        """How many leading ``keys`` ``tier`` holds, asked first about ``LOOKUP_WINDOW``: a
        tier that lacks the first keys (a new prompt misses everywhere) is asked about a few,
        not thousands. If it holds them all, a ``batch`` tier is asked about the rest at once
        (one more round trip; extra keys cost it microseconds), any other in windows
        ``LOOKUP_GROWTH`` times larger each (S3 answers with a HEAD per key: a miss wastes
        at most three times the keys before it)."""
        growth = len(keys) if tier.connector.capabilities.batch else LOOKUP_GROWTH
        run, window = 0, LOOKUP_WINDOW
        while run < len(keys):
            asked = keys[run : run + window]
            try:
                flags = await tier.exists_many(asked)
            except GatewayError as exc:
                log.debug("tier %s: exists failed (%s): %s", tier.name, exc.kind, exc)
                return run
            for k, flag in zip(asked, flags, strict=False):
                if not flag or k in writer.stale:
                    return run
                run += 1
            if len(flags) < len(asked):
                return run  # a short answer: the rest counts as absent
            window *= growth
        return run

    async def contains_many(self, keys: Sequence[KeyLike]) -> list[bool]:
        """Whether each key is stored in any tier (no prefix rule: every key is answered).

        Like ``lookup``, lower tiers answer from existence checks; each is asked only about
        the keys the tiers above it lack. A tier that fails answers "not here"."""
        ks = [normalize_key(k) for k in keys]
        await self._ready()
        found = [(self.l1 is not None and k in self.l1) or self._pending(k) for k in ks]
        for writer, tier in zip(self.writers, self.tiers, strict=True):
            asked = [i for i, hit in enumerate(found) if not hit]
            if not asked:
                break
            try:
                flags = await tier.exists_many([ks[i] for i in asked])
            except GatewayError as exc:
                log.debug("tier %s: exists failed (%s): %s", tier.name, exc.kind, exc)
                continue
            for i, flag in zip(asked, flags, strict=False):
                found[i] = flag and ks[i] not in writer.stale
        return found

    def _pending(self, key: str) -> bool:
        return any(w.pending(key) is not None for w in self.writers)

    async def prefetch(
        self, keys: Sequence[KeyLike], *, deadline: float | None = None
    ) -> asyncio.Task[int]:
        """Promote ``keys`` into L1 in the background; the task gives how many were found."""
        ks = [normalize_key(k) for k in keys]
        await self._ready()
        limit = self.config.prefetch_deadline if deadline is None else deadline

        async def run() -> int:
            sem = asyncio.Semaphore(8)
            found = 0

            async def one(k: str) -> None:
                nonlocal found
                async with sem:
                    in_l1 = self.l1 is not None and k in self.l1
                    if in_l1 or await self._fetch_shared(k) is not None:
                        found += 1

            try:
                async with asyncio.timeout(limit):
                    await asyncio.gather(*(one(k) for k in ks))
            except TimeoutError:
                log.debug("prefetch of %d keys hit its %.1fs deadline", len(ks), limit)
            return found

        return self._spawn(run(), "kvgate-prefetch")

    # -- introspection -------------------------------------------------------------------

    def stats(self) -> dict[str, TierStats]:
        out: dict[str, TierStats] = {}
        if self.l1 is not None:
            out[self.l1.name] = self.l1.stats
        for tier in self.tiers:
            out[tier.name] = tier.stats
        return out

    def tier_names(self) -> list[str]:
        return [*([self.l1.name] if self.l1 else []), *(t.name for t in self.tiers)]


def _check_staged(staged: Slab, data: ObjectData) -> None:
    """``data`` must be ``staged``'s bytes (every path of a put, whether it uses them or not)."""
    if not data.host_ready or staged.nbytes != data.meta.nbytes:
        raise InvalidObject("a staged put's object must be the staged slab's bytes")
    host = data.host()
    if host.nbytes and _address(host) != _address(staged.view()):
        raise InvalidObject("a staged put's object must be the staged slab's bytes")


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _expiry(ttl: float | None, default: float | None) -> float | None:
    ttl = default if ttl is None else ttl
    return None if ttl is None else time.time() + ttl


def is_l1_url(url: str) -> bool:
    """A bare ``memory://`` in first place is the in-process L1 of decoded objects.

    A named ``memory://space`` is an ordinary connector tier holding frames (tests and
    benchmarks use it as a stand-in lower tier).
    """
    parts = urlsplit(url)
    return parts.scheme.lower() == "memory" and not parts.netloc and parts.path in ("", "/")


def check_plugins(config: StoreConfig) -> None:
    """Raise what opening a store on ``config`` would about its plugins, without opening
    anything: an unknown connector scheme or codec (``ConfigError`` naming the tier), a
    codec's bad options or missing file (its ``ConfigError``), a missing extra
    (``MissingDependency``). For a command that should refuse such a config at once, before
    it serves (``kvgate serve``), rather than fail in its start-up."""
    tiers = list(config.tiers)
    names = _tier_names(tiers)
    for i, tcfg in enumerate(tiers):
        if i == 0 and is_l1_url(tcfg.url):
            continue  # the memory tier: no connector, no codec
        with _naming_tier(names[i]):
            connector_class(scheme_of(tcfg.url))
            build_codec(tcfg.codec, tcfg.codec_options)


@contextlib.contextmanager
def _naming_tier(name: str) -> Iterator[None]:
    """A tier's connector or codec refusing its config (an unknown name is the config's
    error too): say which tier."""
    try:
        yield
    except (NotFound, ConfigError) as exc:
        raise ConfigError(f"tier {name}: {exc}") from None


def _tier_names(tiers: Sequence[TierConfig]) -> list[str]:
    schemes = [scheme_of(t.url) for t in tiers]
    names = []
    for i, (t, scheme) in enumerate(zip(tiers, schemes, strict=True)):
        if t.name:
            names.append(t.name)
        elif schemes.count(scheme) > 1:
            names.append(f"{scheme}{i}")
        else:
            names.append(scheme)
    if len(set(names)) != len(names):
        raise ConfigError(f"tier names must be unique, got {names}")
    return names


def _weak_call(method: weakref.WeakMethod[Callable[[], None]]) -> Callable[[], None]:
    """A callback that calls ``method`` while its object lives, and does nothing after."""

    def call() -> None:
        bound = method()
        if bound is not None:
            bound()

    return call


__all__ = ["Store"]
