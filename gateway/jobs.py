"""Bounded per-tier write queues with worker pools and per-key ordering.

Each lower tier gets a ``TierWriter``: a bounded ``asyncio.Queue`` of write jobs drained by a
few worker tasks. A job holds a reference to the pool slab with the object's bytes, so memory is
bounded by the pool however slow the tier is. When the queue is full the tier's back-pressure
policy applies: ``wait`` (the put waits for room) or ``skip`` (the write is dropped and
counted).

Writes of one key must land in order even with several workers: a newer job that finds an
older one still queued marks it superseded (the worker skips it); one that finds it running
waits for it before writing. ``barrier(key)`` gives ``delete`` the same guarantee, so a queued
write can never resurrect a deleted object.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from gateway.errors import GatewayError
from gateway.memory import Slab
from gateway.objects import ObjectData, ObjectMeta
from gateway.tiers import ConnectorTier

log = logging.getLogger("kvgate.jobs")


@dataclass(eq=False, slots=True)
class WriteJob:
    key: str
    meta: ObjectMeta
    slab: Slab  # one reference owned by the job until it finishes
    ttl: float | None = None
    superseded: bool = False
    started: bool = False
    after: WriteJob | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def data(self) -> ObjectData:
        return ObjectData(self.meta, self.slab.view())


class TierWriter:
    def __init__(
        self, tier: ConnectorTier, *, queue_size: int, workers: int, backpressure: str
    ) -> None:
        self.tier = tier
        self.backpressure = backpressure
        self.queue: asyncio.Queue[WriteJob | None] = asyncio.Queue(queue_size)
        self.latest: dict[str, WriteJob] = {}
        self.in_flight = 0
        self._n_workers = workers
        self._workers: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._workers = [
            asyncio.create_task(self._work(), name=f"kvgate-writer-{self.tier.name}-{i}")
            for i in range(self._n_workers)
        ]

    async def submit(self, job: WriteJob) -> bool:
        """Queue ``job`` (which owns a slab reference); False when skipped by back-pressure."""
        self.in_flight += 1
        try:
            if self.backpressure == "skip":
                self.queue.put_nowait(job)
            else:
                await self.queue.put(job)
        except asyncio.QueueFull:
            self.tier.stats.skipped_writes += 1
            self._finish(job)
            return False
        except BaseException:
            self._finish(job)
            raise
        # No await between the enqueue and this bookkeeping, so no worker has seen ``job``.
        prev = self.latest.get(job.key)
        if prev is not None:
            if prev.started:
                job.after = prev
            else:
                prev.superseded = True
        self.latest[job.key] = job
        self.tier.stats.queue_depth = self.queue.qsize()
        return True

    def pending(self, key: str) -> WriteJob | None:
        """The newest unfinished write of ``key`` (its slab holds the bytes), if any."""
        job = self.latest.get(key)
        return job if job is not None and not job.done.is_set() else None

    async def barrier(self, key: str) -> None:
        """Make sure no earlier write of ``key`` lands after this point."""
        job = self.latest.get(key)
        if job is None:
            return
        if not job.started:
            job.superseded = True
            return
        await job.done.wait()

    async def _work(self) -> None:
        while True:
            job = await self.queue.get()
            try:
                if job is None:
                    return
                if job.superseded:
                    continue
                job.started = True
                if job.after is not None:
                    await job.after.done.wait()
                await self.tier.write(job.key, job.data(), job.ttl)
            except asyncio.CancelledError:
                raise
            except GatewayError as exc:  # counted by the metrics layer
                log.warning("tier %s: write failed (%s): %s", self.tier.name, exc.kind, exc)
            except Exception:
                self.tier.stats.count_error("internal")
                log.exception("tier %s: write failed", self.tier.name)
            finally:
                if job is not None:
                    self._finish(job)
                self.queue.task_done()
                self.tier.stats.queue_depth = self.queue.qsize()

    def _finish(self, job: WriteJob) -> None:
        if job.done.is_set():
            return
        self.in_flight -= 1
        job.slab.release()
        job.done.set()
        if self.latest.get(job.key) is job:
            del self.latest[job.key]

    async def drain(self) -> None:
        await self.queue.join()

    async def close(self) -> None:
        """Drain, then stop the workers."""
        await self.drain()
        for _ in self._workers:
            await self.queue.put(None)
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers = []
