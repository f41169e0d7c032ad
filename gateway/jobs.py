"""Bounded per-tier write queues with worker pools and per-key ordering.

Each lower tier gets a ``TierWriter``: a bounded ``asyncio.Queue`` of write jobs drained by a
few worker tasks. A job holds a reference to the pool slab with the object's bytes, so memory is
bounded by the pool however slow the tier is. When the queue is full the tier's back-pressure
policy applies: ``wait`` (the put waits for room) or ``skip`` (the write is dropped and
counted). A ``skip`` tier's writes in flight also pin at most ``pin_limit`` bytes of the pool,
and the store may drop its queued writes to free their slabs (``skip_queued``): see
``Store._alloc`` for why a queue bounded in jobs alone is not enough.

Ordering of one key's writes, whatever the number of workers, rests on one rule: ``latest[key]``
is the newest write intent, registered before anything waits. A queued job is written only if
it is still the latest, and only once nothing else of that key runs in the tier (``running``);
anything older is skipped. The store's own operations on the tier (a delete, or the direct
write of an object too big for the pool) take part through a ``Hold``: it becomes the latest
intent and occupies ``running`` while the operation runs. So an older write never lands after a
newer one or after a delete.

A key is *stale* in a tier while the tier may hold an older version than the newest accepted:
from the moment a hold is taken until its operation succeeds, and after a write that was
skipped by back-pressure, failed or was cancelled. The store never reads a stale key from that
tier; the next successful write or delete of the key clears it, and a clean close deletes the
keys still stale from the tier (``scrub``), since a later store would not know them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from gateway.background import write_behind
from gateway.errors import CircuitOpen, GatewayError, Unavailable
from gateway.log_limit import RepeatLimiter
from gateway.memory import Slab
from gateway.objects import ObjectData, ObjectMeta
from gateway.tiers import ConnectorTier

log = logging.getLogger("kvgate.jobs")

MAX_STALE_KEYS = 1 << 20  # past this, a full queue makes puts wait instead of skipping
SCRUB_SECONDS = 10.0  # what a clean close spends on a tier's stale keys at most (``scrub``)
SCRUB_BATCH = 1024  # keys asked about in one existence check while scrubbing


SUPERSEDED_POLL = 0.05  # seconds: how soon a waiting write notices it was superseded


async def _wait_briefly(event: asyncio.Event) -> None:
    """Wait for ``event``, but at most SUPERSEDED_POLL, so a waiter re-checks whether it was
    superseded instead of holding its worker until a slow write of the key finishes."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(SUPERSEDED_POLL):
            await event.wait()


@dataclass(eq=False, slots=True)
class WriteJob:
    key: str
    meta: ObjectMeta
    slab: Slab  # one reference owned by the job until it finishes
    expires_at: float | None = None  # wall-clock seconds, fixed at put time
    checksum: int | None = None  # xxh3_64 of the slab's bytes, when the put computed it
    position: int | None = None  # the chunk's start position (``Store.put(position=)``)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def data(self) -> ObjectData:
        return ObjectData(
            self.meta, self.slab.view(), checksum=self.checksum, position=self.position
        )


class Hold:
    """The store's own operation on a key in the tier (a delete, a direct write)."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = asyncio.Event()


class TierWriter:
    def __init__(
        self,
        tier: ConnectorTier,
        *,
        queue_size: int,
        workers: int,
        backpressure: str,
        pin_limit: int | None = None,
    ) -> None:
        """``pin_limit``: with ``skip``, the bytes of pool slabs that this tier's unfinished
        writes may hold before further writes are skipped (one write is always admitted)."""
        self.tier = tier
        self.backpressure = backpressure
        self.pin_limit = pin_limit
        self.queue: asyncio.Queue[WriteJob | None] = asyncio.Queue(queue_size)
        self.latest: dict[str, WriteJob | Hold] = {}
        self.running: dict[str, WriteJob | Hold] = {}
        self.stale: set[str] = set()
        # Queued jobs no worker has taken yet, oldest first: the ones that can still be skipped.
        # By slab: a put gives each tier one job, with the put's own slab.
        self.queued: dict[Slab, WriteJob] = {}
        self.in_flight = 0
        self.pinned = 0  # bytes of the slabs that unfinished jobs hold
        self.closed = False
        self.failures = RepeatLimiter()
        self._n_workers = workers
        self._workers: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._workers = [
            asyncio.create_task(self._work(), name=f"kvgate-writer-{self.tier.name}-{i}")
            for i in range(self._n_workers)
        ]

    def register(self, job: WriteJob) -> None:
        """Make ``job`` the newest intent for its key (older writes will be skipped).

        Synchronous, so that a put registers in every tier before its first await: tiers then
        agree on which put is newest, whatever order the queues later take them in.
        """
        self.in_flight += 1
        self.pinned += job.slab.size
        self.latest[job.key] = job

    def can_skip(self) -> bool:
        """Whether writes may be dropped now: ``skip``, and the set of keys this tier may hold
        older versions of is still bounded."""
        return self.backpressure == "skip" and len(self.stale) < MAX_STALE_KEYS

    def behind(self) -> bool:
        """Whether a write now would wait for this tier: its queue is full, or every worker
        is busy with a write."""
        return self.queue.full() or self.in_flight - self.queue.qsize() >= self._n_workers

    def _over_pin_limit(self, job: WriteJob) -> bool:
        others = self.pinned - job.slab.size
        return self.pin_limit is not None and others > 0 and self.pinned > self.pin_limit

    async def enqueue(self, job: WriteJob) -> bool:
        """Queue a registered job; False when skipped by back-pressure."""
        if self.closed:
            self.abandon(job)
            raise Unavailable(f"tier {self.tier.name}: the store is closing")
        try:
            if self.can_skip():
                if self._over_pin_limit(job):
                    raise asyncio.QueueFull
                self.queue.put_nowait(job)
            else:
                await self.queue.put(job)
        except asyncio.QueueFull:
            self.tier.stats.skipped_writes += 1
            self.abandon(job)
            return False
        except BaseException:  # cancelled while waiting for room: same as skipped
            self.abandon(job)
            raise
        finally:
            self.tier.stats.queue_depth = self.queue.qsize()
        self.queued[job.slab] = job
        return True

    def skip_queued(self, slab: Slab) -> bool:
        """Skip (drop and count) the queued job that writes ``slab``, if there is one, so that
        the slab can be freed; its worker later finds it finished and passes over it."""
        job = self.queued.get(slab) if self.can_skip() else None
        if job is None:
            return False
        self.tier.stats.skipped_writes += 1
        self.abandon(job)
        return True

    def abandon(self, job: WriteJob) -> None:
        """A registered job that will not be written: if it was the newest intent, the tier
        may now hold an older version of the key (older queued writes were superseded)."""
        if self.latest.get(job.key) is job:
            self.stale.add(job.key)
        self._finish(job)

    def pending(self, key: str) -> WriteJob | None:
        """The newest unfinished write of ``key`` (its slab holds the bytes), if any."""
        job = self.latest.get(key)
        if isinstance(job, WriteJob) and not job.done.is_set():
            return job
        return None

    def hold(self, key: str) -> Hold:
        """Start a store operation on ``key``: older queued writes will be skipped and the
        tier is not read for the key until ``release(..., ok=True)``. Synchronous, so that a
        caller can hold every tier before its first await."""
        mark = Hold()
        self.latest[key] = mark
        self.stale.add(key)
        return mark

    async def acquire(self, key: str, mark: Hold) -> bool:
        """Wait until nothing else of ``key`` runs, then run as ``mark``; False when a newer
        intent superseded the hold (the operation then must not touch the tier)."""
        while True:
            if self.latest.get(key) is not mark:
                return False
            running = self.running.get(key)
            if running is None:
                self.running[key] = mark
                return True
            await _wait_briefly(running.done)

    def release(self, key: str, mark: Hold, ok: bool) -> None:
        """End the operation; ``ok`` says the tier now holds the newest version (or none)."""
        if self.running.get(key) is mark:
            del self.running[key]
        mark.done.set()
        if self.latest.get(key) is mark:
            del self.latest[key]
            if ok:
                self.stale.discard(key)

    def settled(self, key: str, ok: bool) -> None:
        """A queued write of ``key`` that was the latest intent finished."""
        if ok:
            self.stale.discard(key)
        else:
            self.stale.add(key)

    async def _claim(self, job: WriteJob) -> bool:
        """Wait until ``job`` may run: False when a newer intent has superseded it."""
        while True:
            if self.latest.get(job.key) is not job:
                return False
            running = self.running.get(job.key)
            if running is None:
                self.running[job.key] = job
                return True
            await _wait_briefly(running.done)

    async def _work(self) -> None:
        write_behind()  # nobody waits for these writes: below the replies' CPU priority
        while True:
            job = await self.queue.get()
            try:
                if job is None:
                    return
                self.queued.pop(job.slab, None)
                if await self._claim(job):
                    ok = await self._write(job)
                    if self.latest.get(job.key) is job:
                        self.settled(job.key, ok)
            finally:
                if job is not None:
                    self._finish(job)
                self.queue.task_done()
                self.tier.stats.queue_depth = self.queue.qsize()

    async def _write(self, job: WriteJob) -> bool:
        ttl = None
        if job.expires_at is not None:
            ttl = job.expires_at - time.time()
            if ttl <= 0:  # expired while queued: nothing to write
                return False
        return await self.write_now(job.key, job.data(), ttl) is None

    async def write_now(self, key: str, data: ObjectData, ttl: float | None) -> GatewayError | None:
        """Write to the tier now; a failure is counted, logged (see ``_log_failure``) and
        returned, so that a durable put can raise it."""
        try:
            await self.tier.write(key, data, ttl)
        except GatewayError as exc:  # counted by the metrics layer
            self._log_failure(exc)
            return exc
        except Exception as exc:
            self.tier.stats.count_error("internal")
            log.exception("tier %s: write failed", self.tier.name)
            return GatewayError(f"tier {self.tier.name}: write failed: {exc!r}")
        return None

    def _log_failure(self, exc: GatewayError) -> None:
        """One line for the first failure of a kind, then at most one per interval with the
        number not logged; refusals of an open breaker are left to the breaker, which logs
        its transitions with the number of calls it refused."""
        if isinstance(exc, CircuitOpen):
            return
        quiet = self.failures.admit(exc.kind)
        if quiet is None:
            return
        more = f" ({quiet} more such failures since the last line)" if quiet else ""
        log.warning("tier %s: write failed (%s): %s%s", self.tier.name, exc.kind, exc, more)

    async def scrub(self, seconds: float = SCRUB_SECONDS) -> None:
        """Delete from the tier the keys it may hold older versions of (``stale``), once
        nothing else writes to it: at a clean close.

        Only this process knows which keys are stale (a write of them failed or was skipped,
        or a delete failed), and a disk tier keeps its files across a restart, a remote tier
        outlives the process: a store opened on them later would serve those versions. Keys
        the tier does not hold are only forgotten. What is not done within ``seconds`` (the
        tier is down, or there are very many) is logged; a crash skips this, and then a later
        store can serve an older version, as after any write-back put lost in a crash.
        """
        keys = [key for key in self.stale if key not in self.latest]
        left = len(keys)
        why = "its existence check answered for fewer keys than asked"
        try:
            async with asyncio.timeout(seconds):
                for start in range(0, len(keys), SCRUB_BATCH):
                    batch = keys[start : start + SCRUB_BATCH]
                    # The backend's own answer: a key whose object this store could not
                    # read (``UnreadableKeys``) is still there and may be an older version.
                    held = await self.tier.connector.exists_many(batch)
                    # A short answer leaves the rest unknown: they stay, and are counted left.
                    for key, there in zip(batch, held, strict=False):
                        if there:
                            await self.tier.delete(key)
                        self.stale.discard(key)
                        left -= 1
        except GatewayError as exc:  # a close goes on whatever the tier does; this is logged
            why = str(exc)
        except TimeoutError:
            why = f"over {seconds:g} s"
        except Exception as exc:
            why = repr(exc)
        if left:
            log.warning(
                "tier %s: %d %s it may hold older versions of (a write or delete of them "
                "failed or was skipped) %s not deleted at close (%s); a store opened on this "
                "tier later may serve those versions",
                self.tier.name,
                left,
                "key" if left == 1 else "keys",
                "was" if left == 1 else "were",
                why,
            )

    def _finish(self, job: WriteJob) -> None:
        if job.done.is_set():
            return
        self.in_flight -= 1
        self.pinned -= job.slab.size
        if self.queued.get(job.slab) is job:
            del self.queued[job.slab]
        job.slab.release()
        job.done.set()
        if self.running.get(job.key) is job:
            del self.running[job.key]
        if self.latest.get(job.key) is job:
            del self.latest[job.key]

    async def drain(self) -> None:
        await self.queue.join()

    async def close(self) -> None:
        """Refuse new jobs, drain the queue, stop the workers, then ``scrub``."""
        self.closed = True
        await self.drain()
        for _ in self._workers:
            await self.queue.put(None)
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers = []
        for kind, n in self.failures.unlogged().items():
            log.warning("tier %s: %d more write failures (%s) not logged", self.tier.name, n, kind)
        await self.scrub()
