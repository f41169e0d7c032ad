"""Bounded fan-out and part slicing, shared by the object-store connectors' transfers."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def limited(
    slots: asyncio.Semaphore, job: Callable[[], Awaitable[T]]
) -> Callable[[], Awaitable[T]]:
    """``job`` run while holding one of ``slots``."""

    async def run() -> T:
        async with slots:
            return await job()

    return run


async def run_all(jobs: Sequence[Callable[[], Awaitable[T]]]) -> list[T]:
    """Run ``jobs`` concurrently; their results in order.

    The first failure cancels the rest. Every job has finished when this returns or raises
    (also when the caller is cancelled), so none still writes into a buffer the caller owns.
    """
    if not jobs:
        return []
    tasks = [asyncio.ensure_future(job()) for job in jobs]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()  # a no-op on finished tasks
        while not all(task.done() for task in tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait(tasks)
    failed = [t for t in tasks if not t.cancelled() and t.exception() is not None]
    if failed:
        raise failed[0].exception()  # type: ignore[misc]
    return [task.result() for task in tasks]


def slice_parts(parts: Sequence[memoryview], start: int, end: int) -> list[memoryview]:
    """The pieces of the concatenation of ``parts`` between ``start`` and ``end`` (views)."""
    out: list[memoryview] = []
    offset = 0
    for part in parts:
        lo, hi = max(start, offset), min(end, offset + part.nbytes)
        if lo < hi:
            out.append(part[lo - offset : hi - offset])
        offset += part.nbytes
        if offset >= end:
            break
    return out


def spans(start: int, end: int, step: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + step, end)) for lo in range(start, end, step)]
