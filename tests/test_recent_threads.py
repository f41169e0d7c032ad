"""RecentThreadPool: jobs go to the thread that went idle last; the Executor contract holds."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import CancelledError, Future

import pytest

from gateway.recent_threads import RecentThreadPool
from gateway.thread_jobs import in_thread


def test_back_to_back_calls_stay_on_one_thread() -> None:
    """A caller that waits for each call before the next (what an awaiting coroutine does)
    gets the same thread every time, where the stock pool rotates over the ones it started."""
    pool = RecentThreadPool(4)
    try:
        threads = {pool.submit(threading.get_ident).result() for _ in range(200)}
    finally:
        pool.shutdown()
    assert len(threads) == 1


async def test_awaited_calls_stay_on_one_thread() -> None:
    """The same through the event loop, as the connectors call it (``in_thread`` and
    ``asyncio.wrap_future``)."""
    pool = RecentThreadPool(4)
    try:
        threads = {await in_thread(pool, threading.get_ident) for _ in range(100)}
        threads |= {await asyncio.wrap_future(pool.submit(threading.get_ident)) for _ in range(100)}
    finally:
        pool.shutdown()
    assert len(threads) == 1


def test_up_to_max_workers_run_at_once_and_the_rest_wait_in_order() -> None:
    pool = RecentThreadPool(3)
    gate = threading.Event()
    running = threading.Semaphore(0)
    started: list[int] = []
    lock = threading.Lock()

    def job(i: int) -> int:
        with lock:
            started.append(i)
        running.release()
        gate.wait(10)
        return i

    try:
        futures = [pool.submit(job, i) for i in range(7)]
        for _ in range(3):
            assert running.acquire(timeout=10)
        time.sleep(0.05)
        assert sorted(started) == [0, 1, 2]  # three threads, the others queued
        assert not running.acquire(timeout=0)
        gate.set()
        assert [f.result(timeout=10) for f in futures] == list(range(7))
        assert started[3:] == [3, 4, 5, 6]  # the backlog is first in, first out
    finally:
        gate.set()
        pool.shutdown()


def test_a_job_s_exception_reaches_its_future_and_the_thread_lives_on() -> None:
    pool = RecentThreadPool(1)

    def fail() -> None:
        raise ValueError("boom")

    try:
        with pytest.raises(ValueError, match="boom"):
            pool.submit(fail).result(timeout=10)
        assert pool.submit(lambda: 42).result(timeout=10) == 42
    finally:
        pool.shutdown()


def test_a_job_cancelled_before_it_starts_never_runs() -> None:
    pool = RecentThreadPool(1)
    gate = threading.Event()
    ran: list[str] = []
    try:
        first = pool.submit(gate.wait, 10)
        second = pool.submit(ran.append, "second")
        assert second.cancel()
        gate.set()
        first.result(timeout=10)
        assert pool.submit(ran.append, "third").result(timeout=10) is None
        assert ran == ["third"]
        with pytest.raises(CancelledError):
            second.result()
    finally:
        gate.set()
        pool.shutdown()


def test_shutdown_waits_for_running_jobs_and_refuses_new_ones() -> None:
    pool = RecentThreadPool(2)
    done: list[int] = []

    def slow(i: int) -> None:
        time.sleep(0.1)
        done.append(i)

    futures = [pool.submit(slow, i) for i in range(4)]
    pool.shutdown(wait=True)
    assert sorted(done) == [0, 1, 2, 3]  # the backlog ran too: nothing was cancelled
    assert all(f.done() for f in futures)
    with pytest.raises(RuntimeError, match="shutdown"):
        pool.submit(lambda: None)


def test_shutdown_can_cancel_the_backlog() -> None:
    pool = RecentThreadPool(1)
    gate = threading.Event()
    running = pool.submit(gate.wait, 10)
    queued: list[Future[None]] = [pool.submit(time.sleep, 0) for _ in range(3)]
    threading.Timer(0.1, gate.set).start()
    pool.shutdown(wait=True, cancel_futures=True)
    assert running.result() is True
    assert all(f.cancelled() for f in queued)


def test_idle_threads_exit_at_shutdown() -> None:
    pool = RecentThreadPool(3, thread_name_prefix="test-idle-exit")
    gate = threading.Barrier(3)
    for f in [pool.submit(gate.wait, 10) for _ in range(3)]:
        f.result(timeout=10)

    def ours() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("test-idle-exit")]

    assert len(ours()) == 3
    pool.shutdown(wait=True)
    assert ours() == []


def test_max_workers_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_workers"):
        RecentThreadPool(0)


async def test_many_callers_at_once_all_get_their_answers() -> None:
    pool = RecentThreadPool(4)
    try:
        results = await asyncio.gather(
            *(in_thread(pool, lambda i=i: (time.sleep(0.001), i)[1]) for i in range(200))
        )
    finally:
        pool.shutdown()
    assert results == list(range(200))
