"""A thread pool that gives each job to the thread that went idle last.

``concurrent.futures.ThreadPoolExecutor`` puts jobs on one queue that all its idle threads
wait on, so one caller's back-to-back calls rotate over every thread the pool has started
(it starts a new one whenever a job arrives before the last one's thread is back in the
queue, which a caller awaiting each call makes the rule). Each call then runs on the thread
that has slept longest: cold caches, and, for a client library that keeps state per thread, a
cold copy of that state.

Measured with Mooncake's client (1 MiB puts through the ``mooncake://`` connector, one at a
time, a scratch script on this 2-core VM): 1.25-1.3 ms a put with the stock pool of 4 threads
and 1.15-1.2 with 1 thread; after the process sat idle for 2 s, puts took 2-4 ms for the next
~0.4 s with 4 threads and were back to normal within 1-2 rounds of 16 puts with 1.

Here a job goes to the most recently idle thread (a stack), a new thread starts only when none
is idle (up to ``max_workers``), and jobs beyond that wait in a FIFO backlog that finishing
threads take from. A thread counts as idle *before* its job's future is resolved, so a caller
that submits its next call as soon as the last one returns finds the same thread waiting.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, Literal, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

_Job = tuple[Future[Any], Callable[[], Any]]
_Then = Literal["idle", "exit"]  # what a thread does after its job, when the backlog is empty


class RecentThreadPool(Executor):
    """``Executor`` with ``ThreadPoolExecutor``'s bounds; jobs go to the last idle thread."""

    _names = itertools.count()

    def __init__(self, max_workers: int, thread_name_prefix: str = "kvgate-pool") -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.max_workers = max_workers
        self._prefix = thread_name_prefix
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue[_Job | None]] = []  # inboxes of idle threads
        self._backlog: deque[_Job] = deque()
        self._threads: list[threading.Thread] = []
        self._shut = False

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        future: Future[T] = Future()
        job: _Job = (future, lambda: fn(*args, **kwargs))
        with self._lock:
            if self._shut:
                raise RuntimeError("cannot schedule new futures after shutdown")
            if self._idle:
                self._idle.pop().put(job)
            elif len(self._threads) < self.max_workers:
                self._start(job)
            else:
                self._backlog.append(job)
        return future

    def _start(self, job: _Job) -> None:
        inbox: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        inbox.put(job)
        name = f"{self._prefix}_{next(self._names)}"
        # Daemon threads, like asyncio's: an idle one never holds up the interpreter's exit;
        # a pool's owner shuts it down (waiting for its jobs) when it closes.
        thread = threading.Thread(target=self._work, args=(inbox,), name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _work(self, inbox: queue.SimpleQueue[_Job | None]) -> None:
        job = inbox.get()
        while job is not None:
            future, call = job
            outcome: tuple[bool, Any] | None = None
            if future.set_running_or_notify_cancel():
                try:
                    outcome = (True, call())
                except BaseException as exc:
                    outcome = (False, exc)
            after = self._after_job(inbox)  # before the caller wakes: see the module doc
            if outcome is not None:
                ok, value = outcome
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(value)
            del job, future, call, outcome
            if isinstance(after, tuple):
                job = after
            elif after == "idle":
                job = inbox.get()
            else:
                return

    def _after_job(self, inbox: queue.SimpleQueue[_Job | None]) -> _Job | _Then:
        """The backlog's next job for this thread, else ``"idle"`` (it is now on top of the
        idle stack: a job or the shutdown's None comes to its inbox), or ``"exit"``."""
        with self._lock:
            if self._backlog:
                return self._backlog.popleft()
            if self._shut:
                return "exit"
            self._idle.append(inbox)
            return "idle"

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._shut = True
            if cancel_futures:
                while self._backlog:
                    self._backlog.popleft()[0].cancel()
            for inbox in self._idle:
                inbox.put(None)
            self._idle.clear()
            threads = list(self._threads)
        if wait:
            for thread in threads:
                if thread is not threading.current_thread():
                    thread.join()
