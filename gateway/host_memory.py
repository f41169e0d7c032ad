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
import mmap

import numpy as np

_PAGE = mmap.PAGESIZE
# MADV_POPULATE_WRITE (Linux 5.14): fault every page in, writable, in one call. Not in Python's
# mmap module before 3.13; older kernels answer EINVAL and the pages are touched instead.
_MADV_POPULATE_WRITE = 23


def anonymous_memory(nbytes: int, *, populate: bool, huge_pages: bool) -> mmap.mmap:
    """A zero-filled, page-aligned private anonymous mapping of at least one page, advised for
    transparent huge pages if ``huge_pages``; ``populate`` faults it all in now (~0.1-1 s per
    GiB: not on an event loop) so that first use costs no page faults."""
    memory = mmap.mmap(-1, max(nbytes, _PAGE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if huge_pages and advice is not None:
        # A kernel without transparent huge pages refuses the advice: 4 KiB pages then.
        with contextlib.suppress(OSError):
            memory.madvise(advice)
    if populate:
        try:
            memory.madvise(_MADV_POPULATE_WRITE)
        except OSError:
            np.frombuffer(memory, dtype=np.uint8)[::_PAGE] = 0  # one write faults each page
    return memory
