"""Write-behind at a lower CPU priority than the requests a server answers.

A put through a Store returns once its first tier holds the object; the lower tiers are
written afterwards by the store's tier writers (``gateway.jobs``). That work is nobody's
reply: on a busy machine it should take the CPU time the serving threads leave, not compete
with them. Measured with ``benchmarks/lm_bench.py`` on 2 cores shared with other work: gets
from the memory tier of ``kvgate serve`` with the default memory + disk ran at about half the
speed of a memory-only server, because the disk tier was still copying the puts just made into
the page cache (a thread in ``os.writev`` and ``os.fsync``) while they ran.

``write_behind()`` marks the current task (the writers' tasks) as write-behind; blocking work
that connectors start from it asks ``pool_for`` and runs in threads made by
``low_priority_threads``, whose nice value is ``BACKGROUND_NICE`` higher. Linux keeps a nice
value per thread, so the rest of the process is unaffected; where that cannot be set (another
OS, a sandbox that refuses) the threads run at the normal priority. A durable put's writes
run in the caller's task and stay at the normal priority: the caller waits for them.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import Executor, ThreadPoolExecutor
from contextvars import ContextVar

# CFS gives a nice-10 thread about a tenth of a core that a nice-0 thread also wants; alone, it
# runs at full speed.
BACKGROUND_NICE = 10

_WRITE_BEHIND: ContextVar[bool] = ContextVar("kvgate_write_behind", default=False)


def write_behind() -> None:
    """Mark the current task's blocking work from here on as write-behind (its context only:
    a task has its own copy, so the mark never leaks into another task)."""
    _WRITE_BEHIND.set(True)


def is_write_behind() -> bool:
    return _WRITE_BEHIND.get()


def pool_for(foreground: Executor, background: Executor) -> Executor:
    """``background`` for write-behind work, else ``foreground``."""
    return background if _WRITE_BEHIND.get() else foreground


def low_priority_threads(max_workers: int, name: str) -> ThreadPoolExecutor:
    """A thread pool whose threads run at ``BACKGROUND_NICE`` (see the module docstring)."""
    return ThreadPoolExecutor(
        max_workers=max_workers, thread_name_prefix=name, initializer=lower_this_thread
    )


def lower_this_thread() -> None:
    """Raise the calling thread's nice value by ``BACKGROUND_NICE`` (Linux: per thread)."""
    setpriority = getattr(os, "setpriority", None)
    if setpriority is None:
        return
    with contextlib.suppress(OSError):
        tid = threading.get_native_id()
        setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICE)
