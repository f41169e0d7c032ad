"""Running blocking work in a thread pool and awaiting it, without ever abandoning a job that
still uses the caller's buffers.

One helper for what the disk tier and the CPU offload each did their own way. The job's end
wakes the caller's future directly, one event-loop pass, where ``asyncio.to_thread`` wrapped
in ``ensure_future`` and ``shield`` took four. That did not show in latency here: 32 MiB
disk-tier gets from the page cache had p50s of 2.57-2.91 ms before and 2.51-3.23 ms after
(6 alternations of a scratch script, 192 gets each); the thread wake-ups (~0.1 ms each way on
this VM) and the read itself dominate.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import TypeVar

T = TypeVar("T")


async def in_thread(
    pool: Executor,
    fn: Callable[[], T],
    *,
    on_cancel: Callable[[], None] | None = None,
    on_abandon: Callable[[T], None] | None = None,
) -> T:
    """``fn()`` in ``pool``; its result or exception.

    If the caller is cancelled while ``fn`` runs, ``on_cancel`` is called (to ask ``fn`` to
    stop early), then this waits for ``fn`` to return before re-raising, since ``fn`` may be
    using the caller's buffers. A result ``fn`` produced anyway goes to ``on_abandon`` (to
    commit a finished write, to close a file); if that raises, its error replaces the
    cancellation. A job that had not started is withdrawn.
    """
    loop = asyncio.get_running_loop()
    woken: asyncio.Future[None] = loop.create_future()
    job = pool.submit(fn)
    job.add_done_callback(functools.partial(_wake, loop, woken))
    try:
        await woken
    except asyncio.CancelledError:
        if job.cancel():  # never started: nothing uses the buffers
            raise
        try:
            if on_cancel is not None:
                on_cancel()
        finally:  # whatever on_cancel did, the job may still be using the buffers
            waiting = asyncio.wrap_future(job)
            while not waiting.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait((waiting,))
        # Through the wrapper, so that asyncio sees a failure as retrieved (else it logs
        # "exception was never retrieved" for a job that failed after its caller left).
        if waiting.exception() is None and on_abandon is not None:
            on_abandon(waiting.result())
        raise
    return job.result()


def _wake(loop: asyncio.AbstractEventLoop, woken: asyncio.Future[None], _job: Future[T]) -> None:
    """(in the pool's thread) Resume the waiting caller."""
    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
        loop.call_soon_threadsafe(_resolve, woken)


def _resolve(woken: asyncio.Future[None]) -> None:
    if not woken.done():  # not cancelled meanwhile
        woken.set_result(None)
