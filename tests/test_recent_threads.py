"""RecentThreadPool: jobs go to the thread that went idle last; the Executor contract holds."""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
import time
import weakref
from concurrent.futures import CancelledError, Future

import pytest

from gateway.recent_threads import RecentThreadPool
from gateway.thread_jobs import in_thread


def test_back_to_back_calls_stay_on_one_thread() -> None:
    """A caller that waits for each call before the next gets the same thread every time."""
    pool = RecentThreadPool(4)
    try:
        threads = {pool.submit(threading.get_ident).result(timeout=10) for _ in range(200)}
    finally:
        pool.shutdown()
    assert len(threads) == 1


async def test_awaited_calls_stay_on_one_thread() -> None:
    """The same through the event loop, as the connectors call it (``in_thread`` and
    ``asyncio.wrap_future``), where ``ThreadPoolExecutor`` spreads such calls over several
    threads (it starts one whenever a call comes before the last one's thread is back)."""
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
            second.result(timeout=10)
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


def test_shutdown_can_cancel_what_has_not_started() -> None:
    pool = RecentThreadPool(1)
    gate = threading.Event()
    running = pool.submit(gate.wait, 10)
    queued: list[Future[None]] = [pool.submit(time.sleep, 0) for _ in range(3)]
    pool.shutdown(wait=False, cancel_futures=True)
    assert all(f.cancelled() for f in queued)
    gate.set()
    pool.shutdown(wait=True)
    assert running.result(timeout=10) is True


def test_shutdown_cancels_a_job_handed_to_a_thread_that_has_not_started_it() -> None:
    """The thread is still resolving its last job (a slow done callback) when the next job
    is handed to it and the pool is shut down with ``cancel_futures``."""
    pool = RecentThreadPool(1)
    in_callback, leave_callback = threading.Event(), threading.Event()
    first = pool.submit(lambda: None)
    first.add_done_callback(lambda _: (in_callback.set(), leave_callback.wait(10)))
    assert in_callback.wait(10)
    ran: list[str] = []
    second = pool.submit(ran.append, "second")
    pool.shutdown(wait=False, cancel_futures=True)
    leave_callback.set()
    pool.shutdown(wait=True)
    assert second.cancelled()
    assert ran == []


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


def test_a_dropped_pool_s_threads_end() -> None:
    for _ in range(5):
        pool = RecentThreadPool(2, thread_name_prefix="test-dropped")
        pool.submit(lambda: 1).result(timeout=10)
        del pool
    gc.collect()
    deadline = time.monotonic() + 10
    while any(t.name.startswith("test-dropped") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "threads of dropped pools still run"
        time.sleep(0.01)


def test_an_idle_thread_keeps_nothing_of_its_last_job() -> None:
    pool = RecentThreadPool(2)
    gate = threading.Barrier(2)
    try:

        class Big:
            pass

        # Two threads; the second finishes last, so the next jobs all go to it and the
        # first stays idle with whatever it kept of its job.
        first = pool.submit(lambda: (gate.wait(10), Big())[1])
        pool.submit(gate.wait, 10).result(timeout=10)
        kept = weakref.ref(first.result(timeout=10))
        del first
        for _ in range(20):
            pool.submit(lambda: None).result(timeout=10)
        gc.collect()
        assert kept() is None
    finally:
        pool.shutdown()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_thread_killed_by_a_done_callback_loses_no_job() -> None:
    """A done callback that raises ``SystemExit`` ends its thread (as with the stock pool);
    a job handed to that thread meanwhile still runs."""
    pool = RecentThreadPool(1)
    try:
        gate = threading.Event()

        def first_job() -> threading.Thread:
            gate.wait(10)
            return threading.current_thread()

        first = pool.submit(first_job)
        first.add_done_callback(lambda _: sys.exit())
        gate.set()
        assert pool.submit(lambda: 2).result(timeout=10) == 2
        assert pool.submit(lambda: 3).result(timeout=10) == 3
        killed = first.result(timeout=10)
        killed.join(10)  # its end is reported now, under this test's warning filter
        assert not killed.is_alive()
    finally:
        pool.shutdown()


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
