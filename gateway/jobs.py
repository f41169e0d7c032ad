"""Bounded per-tier write queues with worker pools and per-key ordering.

Each lower tier gets a ``TierWriter``: a bounded ``asyncio.Queue`` of write jobs drained by a
few worker tasks. A job holds a reference to the pool slab with the object's bytes, so memory is
bounded by the pool however slow the tier is. When the queue is full the tier's back-pressure
policy applies: ``wait`` (the put waits for room) or ``skip`` (the write is dropped and
counted).

Ordering of one key's writes, whatever the number of workers, rests on one rule: ``latest[key]``
is the newest write intent (a job, or a barrier for a delete), registered before the job waits
for queue room. A worker writes a job only if it is still the latest, and only once no other
write of that key is running; anything older is skipped. So an older write never lands after a
newer one or after a delete.

A key whose newest write could not be made (skipped by back-pressure, or failed) is *stale* in
that tier: the tier may still hold an older version, so the store does not read the key from it
until a later write or delete of the key succeeds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from gateway.errors import GatewayError, Unavailable
from gateway.memory import Slab
from gateway.objects import ObjectData, ObjectMeta
from gateway.tiers import ConnectorTier

log = logging.getLogger("kvgate.jobs")

MAX_STALE_KEYS = 1 << 20  # past this, a full queue makes puts wait instead of skipping


@dataclass(eq=False, slots=True)
class WriteJob:
    key: str
    meta: ObjectMeta
    slab: Slab  # one reference owned by the job until it finishes
    expires_at: float | None = None  # wall-clock seconds, fixed at put time
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def data(self) -> ObjectData:
        return ObjectData(self.meta, self.slab.view())


class Barrier:
    """A write intent that writes nothing: queued writes older than it are skipped."""

    __slots__ = ()


class TierWriter:
    def __init__(
        self, tier: ConnectorTier, *, queue_size: int, workers: int, backpressure: str
    ) -> None:
        self.tier = tier
        self.backpressure = backpressure
        self.queue: asyncio.Queue[WriteJob | None] = asyncio.Queue(queue_size)
        self.latest: dict[str, WriteJob | Barrier] = {}
        self.running: dict[str, WriteJob] = {}
        self.stale: set[str] = set()
        self.in_flight = 0
        self.closed = False
        self._n_workers = workers
        self._workers: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._workers = [
            asyncio.create_task(self._work(), name=f"kvgate-writer-{self.tier.name}-{i}")
            for i in range(self._n_workers)
        ]

    async def submit(self, job: WriteJob) -> bool:
        """Queue ``job`` (which owns a slab reference); False when skipped by back-pressure."""
        if self.closed:
            job.slab.release()
            raise Unavailable(f"tier {self.tier.name}: the store is closing")
        self.in_flight += 1
        self.latest[job.key] = job  # from here on, older writes of the key are skipped
        try:
            if self.backpressure == "skip" and len(self.stale) < MAX_STALE_KEYS:
                self.queue.put_nowait(job)
            else:
                await self.queue.put(job)
        except asyncio.QueueFull:
            self.tier.stats.skipped_writes += 1
            self.stale.add(job.key)
            self._finish(job)
            return False
        except BaseException:
            self._finish(job)
            raise
        finally:
            self.tier.stats.queue_depth = self.queue.qsize()
        return True

    def pending(self, key: str) -> WriteJob | None:
        """The newest unfinished write of ``key`` (its slab holds the bytes), if any."""
        job = self.latest.get(key)
        if isinstance(job, WriteJob) and not job.done.is_set():
            return job
        return None

    async def barrier(self, key: str) -> None:
        """After this, no write of ``key`` accepted before it can land in the tier."""
        mark = Barrier()
        self.latest[key] = mark
        while (running := self.running.get(key)) is not None:
            await running.done.wait()
        if self.latest.get(key) is mark:
            del self.latest[key]

    def settled(self, key: str, ok: bool) -> None:
        """The store wrote or deleted ``key`` in the tier itself (after a barrier)."""
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
            await running.done.wait()

    async def _work(self) -> None:
        while True:
            job = await self.queue.get()
            try:
                if job is None:
                    return
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
        try:
            await self.tier.write(job.key, job.data(), ttl)
        except asyncio.CancelledError:
            raise
        except GatewayError as exc:  # counted by the metrics layer
            log.warning("tier %s: write failed (%s): %s", self.tier.name, exc.kind, exc)
            return False
        except Exception:
            self.tier.stats.count_error("internal")
            log.exception("tier %s: write failed", self.tier.name)
            return False
        return True

    def _finish(self, job: WriteJob) -> None:
        if job.done.is_set():
            return
        self.in_flight -= 1
        job.slab.release()
        job.done.set()
        if self.running.get(job.key) is job:
            del self.running[job.key]
        if self.latest.get(job.key) is job:
            del self.latest[job.key]

    async def drain(self) -> None:
        await self.queue.join()

    async def close(self) -> None:
        """Refuse new jobs, drain the queue, then stop the workers."""
        self.closed = True
        await self.drain()
        for _ in self._workers:
            await self.queue.put(None)
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers = []
