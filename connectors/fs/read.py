"""How the ``file://`` connector reads a record's data: in the calling worker thread and, for
a large object, a helper thread beside it, through the page cache or with O_DIRECT.

All of this blocks; the connector runs it in worker threads.
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

from connectors.fs import record as rec
from gateway.connector import FillHook

PARALLEL_READ_BYTES = 8 << 20
# direct_io moves objects of at least this size with O_DIRECT; smaller ones are not worth a
# bounce buffer and cost little page cache.
DIRECT_IO_BYTES = 1 << 20


# A large get reads in two threads: the one its job runs in and a helper from this pool. The
# helper is started from the job's thread, so a get costs the event loop one thread hop. Four
# helpers cover more large gets at once than two cores can feed; a get whose helper waits in
# the queue reads every step itself and withdraws the helper (see _finish).
def _read_helpers() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvgate-fs-read")


_READ_HELPERS = _read_helpers()


def _new_helpers_after_fork() -> None:
    global _READ_HELPERS  # a forked child inherits the executor but not its threads
    _READ_HELPERS = _read_helpers()


os.register_at_fork(after_in_child=_new_helpers_after_fork)


def read_object(
    open_fd: Callable[[], int],
    key: str,
    buf: memoryview,
    filled: FillHook | None,
    stop: threading.Event,
    direct: bool = False,
    phase: int | None = None,
) -> None:
    """Check the record that ``open_fd()`` opens and read its data into ``buf`` (exactly its
    size).

    A read from the page cache is a memory copy that one thread cannot saturate: a large one
    also runs in a helper thread, both taking interleaved steps (``record.Steps``), which
    nearly halves a warm 32 MiB get. The helper is always waited for (or withdrawn before it
    started), so no thread writes into ``buf`` or reads a closed fd after this returns.
    ``filled`` is the allocator's hook. ``direct``: read with O_DIRECT (no page cache);
    ``phase``: the index's, of a padded record, which an object under PARALLEL_READ_BYTES is
    then read with in one call (``record.read_padded``).
    """
    fd = open_fd()
    try:
        if (
            direct
            and phase is not None
            and buf.nbytes < PARALLEL_READ_BYTES
            and rec.placed_for(key, buf, phase)
            and _set_direct(fd)
        ):
            if stop.is_set():
                raise rec.Stopped
            rec.read_padded(fd, key, buf, phase, filled)
            return
        record = rec.record_of(fd, key)
        if record.data_len != buf.nbytes:
            raise rec.SizeChanged(record.data_len)
        offset = record.data_offset
        if direct and _set_direct(fd):
            steps = rec.Steps.direct(buf, offset)
        else:
            steps = rec.Steps.even(buf.nbytes)
        if buf.nbytes < PARALLEL_READ_BYTES:
            rec.read_steps(fd, buf, offset, steps, stop, filled)
            return
        helper = _READ_HELPERS.submit(_read_or_halt, fd, buf, offset, steps, stop, filled)
        try:
            rec.read_steps(fd, buf, offset, steps, stop, filled)
        except BaseException as exc:
            stop.set()  # the helper stops at its next step
            failed = _finish(helper)
            if isinstance(exc, rec.Stopped) and failed is not None:
                raise failed from None  # the helper's failure is what stopped this thread
            raise
        failed = _finish(helper)
        if failed is not None:
            raise failed
    finally:
        os.close(fd)  # a close of a read-only fd does not wait for the disk


def _read_or_halt(
    fd: int,
    buf: memoryview,
    offset: int,
    steps: rec.Steps,
    stop: threading.Event,
    filled: FillHook | None,
) -> None:
    """The helper's part: on failure, stop the other thread too instead of reading on."""
    try:
        rec.read_steps(fd, buf, offset, steps, stop, filled)
    except BaseException:
        stop.set()
        raise


def _finish(helper: Future[None]) -> BaseException | None:
    """Withdraw the helper if it never started, else wait for it; its error, if any."""
    if helper.cancel():
        return None
    wait([helper])
    return helper.exception()


def _set_direct(fd: int) -> bool:
    """Switch ``fd`` to O_DIRECT; False where the filesystem refuses it (reads stay buffered)."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
    except OSError:
        return False
    return True
