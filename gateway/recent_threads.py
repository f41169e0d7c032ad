"""A thread pool that gives each job to the thread that went idle last.

``concurrent.futures.ThreadPoolExecutor`` puts jobs on one queue that all its idle threads
wait on, so one caller's back-to-back calls rotate over every thread the pool has started
(it starts a new one whenever a job arrives before the last one's thread is back in the
queue, which a caller awaiting each call makes the rule). Each call then runs on the thread
that has slept longest: cold caches, and, for a client library that keeps state per thread, a
cold copy of that state.

Measured with Mooncake's client (1 MiB puts through the ``mooncake://`` connector, one at a
time, a scratch script on this 2-core VM): 1.2-1.4 ms a put with the stock pool of 4 threads
and 1.15-1.2 with 1 thread; after the process sat idle for 2 s, puts took 2-4 ms for the next
~0.4 s with 4 threads and were back to normal within 1-2 rounds of 16 puts with 1.

Here a job goes to the most recently idle thread (a stack), a new thread starts only when none
is idle (up to ``max_workers``), and jobs beyond that wait in a FIFO backlog that finishing
threads take from. A thread counts as idle *before* its job's future is resolved, so a caller
that submits its next call as soon as the last one returns finds the same thread waiting. The
future's done callbacks therefore run on a thread that may already have its next job: a
callback must not wait for a job of this pool (none of kvgate's does: they hand the result to
an event loop).

Like ``ThreadPoolExecutor``: ``shutdown`` lets running and queued jobs finish unless
``cancel_futures``; a pool that is dropped without ``shutdown`` lets its threads end once idle;
at interpreter exit, running and queued jobs finish before the interpreter goes on. Unlike it,
a pool inherited by a forked child works there (it starts threads of its own).
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, Literal, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

_Job = tuple[Future[Any], Callable[[], Any]]
_Inbox = queue.SimpleQueue[_Job | None]
_Then = Literal["idle", "exit"]  # what a thread does after its job, when the backlog is empty

_live: weakref.WeakSet[RecentThreadPool] = weakref.WeakSet()


def _at_exit() -> None:
    """Before the interpreter joins its threads: let every pool finish its jobs and stop."""
    for pool in list(_live):
        pool.shutdown(wait=True)


# ThreadPoolExecutor's hook: it runs before non-daemon threads are joined (atexit would run
# after, and wait forever for idle threads). Daemon threads where it is missing.
_register_atexit: Callable[[Callable[[], None]], None] | None = getattr(
    threading, "_register_atexit", None
)
if _register_atexit is not None:
    _register_atexit(_at_exit)


class _State:
    """What the threads share, without a reference to the pool (so that it can be dropped)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.idle: list[_Inbox] = []  # inboxes of idle threads, the last idle on top
        self.backlog: deque[_Job] = deque()
        self.threads: list[threading.Thread] = []
        self.shut = False
        self.cancelling = False  # shutdown(cancel_futures=True): jobs not started are cancelled

    def stop_idle(self) -> None:
        with self.lock:
            self.shut = True
            for inbox in self.idle:
                inbox.put(None)
            self.idle.clear()


class RecentThreadPool(Executor):
    """``Executor`` with ``ThreadPoolExecutor``'s bounds; jobs go to the last idle thread."""

    _names = itertools.count()

    def __init__(self, max_workers: int, thread_name_prefix: str = "kvgate-pool") -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.max_workers = max_workers
        self._prefix = thread_name_prefix
        self._state = _State()
        # Dropped without shutdown: idle threads end now, busy ones after their job.
        weakref.finalize(self, self._state.stop_idle)
        _live.add(self)

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        future: Future[T] = Future()
        job: _Job = (future, lambda: fn(*args, **kwargs))
        state = self._state
        with state.lock:
            if state.shut:
                raise RuntimeError("cannot schedule new futures after shutdown")
            _dispatch(state, job, self._prefix, self.max_workers)
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        state = self._state
        with state.lock:
            if cancel_futures:
                state.cancelling = True
                while state.backlog:
                    state.backlog.popleft()[0].cancel()
            threads = list(state.threads)
        state.stop_idle()
        if wait:
            for thread in threads:
                if thread is not threading.current_thread():
                    thread.join()


def _dispatch(state: _State, job: _Job, prefix: str, max_workers: int) -> None:
    """(under the lock) To the last idle thread, a new one, or the backlog."""
    if state.idle:
        state.idle.pop().put(job)
    elif len(state.threads) < max_workers:
        _start(state, job, prefix)
    else:
        state.backlog.append(job)


def _start(state: _State, job: _Job, prefix: str) -> None:
    inbox: _Inbox = queue.SimpleQueue()
    inbox.put(job)
    name = f"{prefix}_{next(RecentThreadPool._names)}"
    daemon = _register_atexit is None
    thread = threading.Thread(target=_work, args=(state, inbox), name=name, daemon=daemon)
    thread.start()  # may raise (no more threads): the caller's submit raises, nothing is kept
    state.threads.append(thread)


def _work(state: _State, inbox: _Inbox) -> None:
    try:
        job = inbox.get()
        while job is not None:
            future, call = job
            if state.cancelling:
                future.cancel()
            outcome: tuple[bool, Any] | None = None
            if future.set_running_or_notify_cancel():
                try:
                    outcome = (True, call())
                except BaseException as exc:
                    outcome = (False, exc)
            after = _after_job(state, inbox)  # before the caller wakes: see the module doc
            if outcome is not None:
                try:
                    _resolve(future, outcome)
                except BaseException:  # a done callback raised SystemExit or the like
                    if isinstance(after, tuple):  # the next job goes back for another thread
                        with state.lock:
                            state.backlog.appendleft(after)
                    raise
            del job, future, call, outcome  # an idle thread keeps nothing of its last job
            if isinstance(after, tuple):
                job = after
            elif after == "idle":
                job = inbox.get()
            else:
                return
    finally:
        _retire(state, inbox)


def _resolve(future: Future[Any], outcome: tuple[bool, Any]) -> None:
    ok, value = outcome
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


def _after_job(state: _State, inbox: _Inbox) -> _Job | _Then:
    """The backlog's next job for this thread, else ``"idle"`` (it is now on top of the idle
    stack: a job or the shutdown's None comes to its inbox), or ``"exit"``."""
    with state.lock:
        if state.backlog:
            return state.backlog.popleft()
        if state.shut:
            return "exit"
        state.idle.append(inbox)
        return "idle"


def _retire(state: _State, inbox: _Inbox) -> None:
    """A thread ends (shutdown, or a done callback raised SystemExit and the like): it leaves
    the idle stack, and a job already handed to it goes to another thread or the backlog."""
    current = threading.current_thread()
    with state.lock:
        if inbox in state.idle:
            state.idle.remove(inbox)
        if current in state.threads:
            state.threads.remove(current)
        while True:
            try:
                job = inbox.get_nowait()
            except queue.Empty:
                break
            if job is None:
                continue
            if state.idle:
                state.idle.pop().put(job)
            else:
                state.backlog.appendleft(job)
        if state.backlog and not state.threads:  # nobody left to run them
            _start(state, state.backlog.popleft(), current.name.rpartition("_")[0])


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's threads: every pool starts afresh (jobs in
    flight at the fork belong to the parent's futures)."""
    for pool in list(_live):
        state = pool._state
        state.lock = threading.Lock()
        state.idle.clear()
        state.backlog.clear()
        state.threads.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
