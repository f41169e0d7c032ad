"""gateway.thread_jobs.in_thread: results, errors, and cancellation that never abandons a job."""

from __future__ import annotations

import asyncio
import functools
import gc
import threading
from collections.abc import Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from gateway.thread_jobs import in_thread


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=1) as executor:
        yield executor


async def cancel_when_started(
    call: Coroutine[Any, Any, Any],
    started: threading.Event,
    raises: type[BaseException] = asyncio.CancelledError,
) -> None:
    """Run ``call``, cancel it once its job has started, and expect ``raises`` from it."""
    task = asyncio.ensure_future(call)
    await asyncio.to_thread(started.wait, 5)
    task.cancel()
    with pytest.raises(raises):
        await task


class GatedJob:
    """A job that says when it has started, then runs until released (5 s at most)."""

    def __init__(self, result: str = "result") -> None:
        self.started, self.release = threading.Event(), threading.Event()
        self.finished = 0
        self.result = result

    def __call__(self) -> str:
        self.started.set()
        self.release.wait(5)
        self.finished += 1
        return self.result


async def test_result_and_thread(pool: ThreadPoolExecutor) -> None:
    caller = threading.get_ident()
    assert await in_thread(pool, lambda: threading.get_ident() != caller)


async def test_exception_propagates(pool: ThreadPoolExecutor) -> None:
    def fail() -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        await in_thread(pool, fail)


async def test_cancel_waits_for_the_job_and_asks_it_to_stop(pool: ThreadPoolExecutor) -> None:
    job = GatedJob()
    abandoned: list[str] = []
    await cancel_when_started(
        in_thread(pool, job, on_cancel=job.release.set, on_abandon=abandoned.append),
        job.started,
    )
    # The job had returned before the cancellation reached the caller, and its result was
    # handed over instead of dropped.
    assert job.finished == 1
    assert abandoned == ["result"]


async def test_repeated_cancels_still_wait(pool: ThreadPoolExecutor) -> None:
    job = GatedJob()
    task = asyncio.ensure_future(in_thread(pool, job))
    await asyncio.to_thread(job.started.wait, 5)
    for _ in range(3):
        task.cancel()
        await asyncio.sleep(0.01)
    assert not task.done()  # still waiting for the job, whatever the caller was told
    job.release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert job.finished == 1


async def test_failed_job_is_not_abandoned_to_the_hook(pool: ThreadPoolExecutor) -> None:
    started = threading.Event()
    abandoned: list[object] = []

    def job() -> None:
        started.set()
        threading.Event().wait(0.1)
        raise OSError("disk")

    await cancel_when_started(in_thread(pool, job, on_abandon=abandoned.append), started)
    assert abandoned == []


async def test_cancel_before_start_withdraws_the_job(pool: ThreadPoolExecutor) -> None:
    block = GatedJob()
    ran: list[bool] = []
    cancelled: list[bool] = []
    blocker = asyncio.ensure_future(in_thread(pool, block))
    await asyncio.to_thread(block.started.wait, 5)
    queued = asyncio.ensure_future(
        in_thread(pool, lambda: ran.append(True), on_cancel=lambda: cancelled.append(True))
    )
    await asyncio.sleep(0.01)
    queued.cancel()
    with pytest.raises(asyncio.CancelledError):
        await queued  # returns at once: the pool's only thread is still busy
    block.release.set()
    await blocker
    assert ran == []
    assert cancelled == []


async def test_many_jobs_resume_their_own_callers(pool: ThreadPoolExecutor) -> None:
    def square(i: int) -> int:
        return i * i

    results = await asyncio.gather(
        *(in_thread(pool, functools.partial(square, i)) for i in range(200))
    )
    assert results == [i * i for i in range(200)]


async def test_a_job_failing_after_its_caller_left_is_not_reported_as_unretrieved(
    pool: ThreadPoolExecutor,
) -> None:
    started = threading.Event()
    reported: list[dict[str, object]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))

    def job() -> None:
        started.set()
        threading.Event().wait(0.05)
        raise OSError("disk full")

    await cancel_when_started(in_thread(pool, job), started)
    gc.collect()  # asyncio reports unretrieved exceptions when the future is collected
    await asyncio.sleep(0)
    assert reported == []


async def test_a_failing_on_cancel_still_waits_for_the_job(pool: ThreadPoolExecutor) -> None:
    job = GatedJob()

    def broken_stop() -> None:
        job.release.set()
        raise RuntimeError("stop hook failed")

    await cancel_when_started(
        in_thread(pool, job, on_cancel=broken_stop), job.started, RuntimeError
    )
    assert job.finished == 1  # the job had returned before the error reached the caller
