"""Anonymous host memory for large I/O buffers, backed by transparent huge pages where the
kernel allows it.

Why huge pages: an O_DIRECT read's request to the disk can hold at most ``max_segments``
physically contiguous pieces of memory (254 on this machine's virtio disk). Into 4 KiB pages
that are scattered in physical memory, a request then carries ~1 MiB; into 2 MiB pages, the
full ``max_sectors_kb`` (4 MiB). Measured here (scratch script, 16 files of 32 MiB, 4 rounds):
O_DIRECT reads took a median 39-40 ms per file into a populated 4 KiB-page mapping and
11-13 ms into one advised for huge pages. numpy already advises its own large arrays so
(``np.ones`` buffers got huge pages here), which is why a raw baseline reading into numpy
memory could beat the store's pool by that much.

Why not always: buffered I/O did not gain from them here and seemed to lose. With the store's
pool in huge pages, raw buffered I/O run right after the store had put, read and deleted 1 GiB
through the page cache and closed was slower (scratch script, 4 alternated rounds: write+fsync
at 1.30-1.69 GB/s against 1.90-2.09 with small pages, page-cache reads at 5.3-11.2 against
13.5-14.6 GB/s; the store's own puts, 0.89-1.92 against 1.14-1.81, were too noisy to tell),
and ``kvgate bench`` runs of the page-cache tier showed the same after-store slowdown. Why is not
known (kernel compaction, or the VM returning freed 2 MiB blocks to its host, are guesses). So
the store asks for huge pages where O_DIRECT uses its memory (``StoreConfig.huge_pages``).

The kernel's THP mode here is ``madvise``: a mapping gets huge pages only when advised, and
only for pages faulted after the advice, so the advice comes before populating. Where THP or
the advice is not available, this is ordinary anonymous memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
from collections.abc import Callable

import numpy as np

_PAGE = mmap.PAGESIZE
# MADV_POPULATE_WRITE (Linux 5.14): fault every page in, writable, in one call. Not in Python's
# mmap module before 3.13; older kernels answer EINVAL and the pages are touched instead.
_MADV_POPULATE_WRITE = 23


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise through ctypes, which lets go of the GIL during the call. Python's own
    ``mmap.madvise`` holds it: populating 1 GiB that way stalled every other thread, the event
    loop's included, for 3.4 s here (scratch script; ctypes: 2 ms at most, a numpy touch of
    every page: 4 ms)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _libc_madvise()


def anonymous_memory(nbytes: int, *, populate: bool, huge_pages: bool) -> mmap.mmap:
    """A zero-filled, page-aligned private anonymous mapping of at least one page, advised for
    transparent huge pages if ``huge_pages``; ``populate`` faults it all in now (~0.1-1 s per
    GiB, in the calling thread without holding the GIL) so that first use costs no page
    faults."""
    memory = mmap.mmap(-1, max(nbytes, _PAGE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if huge_pages and advice is not None:
        # A kernel without transparent huge pages refuses the advice: 4 KiB pages then.
        with contextlib.suppress(OSError):
            memory.madvise(advice)  # sets a flag on the mapping: quick
    if populate:
        _populate(np.frombuffer(memory, dtype=np.uint8))
    return memory


def _populate(pages: np.ndarray[tuple[int], np.dtype[np.uint8]]) -> None:
    if _MADVISE is not None:
        if _MADVISE(pages.ctypes.data, pages.nbytes, _MADV_POPULATE_WRITE) == 0:
            return
        err = ctypes.get_errno()
        if err != errno.EINVAL:  # out of memory, say: not a reason to touch it all
            raise OSError(err, f"madvise(MADV_POPULATE_WRITE): {os.strerror(err)}")
    pages[::_PAGE] = 0  # one write faults each page in (numpy lets go of the GIL)
