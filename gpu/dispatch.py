"""Where a kernel runs: CUDA (cupy) for tensors on a GPU, compiled CPU kernels (numba) on the
host, and the torch reference when neither is installed.

Every kernel has three implementations with one contract: ``gpu.reference`` (torch, the
executable spec; runs on any device), ``gpu.cpu`` (numba, ``nogil``; parallel through
``run_chunks``) and ``gpu.cuda`` (cupy raw kernels). cupy and numba are imported only when a
kernel is first used, so importing a codec costs nothing. ``KVGATE_KERNELS=reference`` forces
the torch reference everywhere (for debugging and for comparing implementations).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, Literal, TypeVar

if TYPE_CHECKING:
    import torch

T = TypeVar("T")
Backend = Literal["cuda", "cpu", "reference"]


def forced_reference() -> bool:
    return os.environ.get("KVGATE_KERNELS", "").strip().lower() == "reference"


@functools.cache
def has_numba() -> bool:
    return importlib.util.find_spec("numba") is not None


@functools.cache
def has_cupy() -> bool:
    """cupy is installed and sees a CUDA device."""
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        import cupy

        return bool(cupy.cuda.runtime.getDeviceCount() > 0)
    except Exception:  # no driver, no device, a broken install: the reference still works
        return False


def is_cuda(t: torch.Tensor) -> bool:
    return bool(t.device.type == "cuda")


def backend_for(t: torch.Tensor) -> Backend:
    """The implementation to use for a tensor on ``t``'s device."""
    if forced_reference():
        return "reference"
    if is_cuda(t):
        return "cuda" if has_cupy() else "reference"
    return "cpu" if has_numba() else "reference"


# CPU kernels release the GIL (numba ``nogil``) and are split into chunks run on these threads.
# numba's own ``parallel=True`` is not used: its default threading layer aborts the process when
# two threads launch parallel kernels at once, and the store encodes several objects at once.
_WORKERS = max(1, os.cpu_count() or 1)
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
_IN_KERNEL_THREAD = threading.local()


def _forget_pool_after_fork() -> None:
    # A forked child inherits the pool object but none of its threads: work sent to it would
    # never run. The child makes its own pool on first use.
    global _POOL, _POOL_LOCK
    _POOL = None
    _POOL_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_pool_after_fork)


def cpu_workers() -> int:
    return _WORKERS


def _mark_kernel_thread() -> None:
    _IN_KERNEL_THREAD.active = True


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(
                max_workers=_WORKERS,
                thread_name_prefix="kvgate-kernel",
                initializer=_mark_kernel_thread,
            )
        return _POOL


def split_range(n: int, parts: int | None = None) -> list[tuple[int, int]]:
    """``[0, n)`` cut into at most ``parts`` (default: one per CPU) contiguous, non-empty pieces."""
    parts = max(1, min(parts or _WORKERS, n))
    step, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + step + (1 if i < extra else 0)
        if end > start:
            out.append((start, end))
        start = end
    return out


def run_chunks(fn: Callable[[int, int], T], ranges: Sequence[tuple[int, int]]) -> list[T]:
    """``fn(start, end)`` for every range, the first inline and the rest on the kernel threads.

    Every chunk has finished when this returns or raises: chunks write into caller buffers that
    the caller may release right after. Called from a kernel thread (a codec used inside
    another kernel), everything runs inline, since waiting on the pool from the pool could
    deadlock it.
    """
    if len(ranges) <= 1 or getattr(_IN_KERNEL_THREAD, "active", False):
        return [fn(*r) for r in ranges]
    futures = [_pool().submit(fn, *r) for r in ranges[1:]]
    try:
        first = fn(*ranges[0])
    finally:
        wait(futures)
    return [first, *(f.result() for f in futures)]


def parallel(fn: Callable[[int, int], Any], n: int, min_per_chunk: int = 1) -> None:
    """Run ``fn(start, end)`` over ``[0, n)`` on all CPU kernel threads."""
    if n <= 0:
        return
    parts = max(1, min(_WORKERS, n // max(1, min_per_chunk)))
    run_chunks(fn, split_range(n, parts))
