"""The disk side of ``kvgate bench``: raw write+fsync and read of files, the baseline a file
tier is compared with, and the helpers that put both sides' phases in the same state.

``direct``: the baseline writes and reads with O_DIRECT from page-aligned memory, as the file
tier does with its ``direct_io`` option, so that both sides bypass the page cache.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from gateway.connector import PLACEMENT
from gateway.host_memory import anonymous_memory

DIO_ALIGN = PLACEMENT  # what O_DIRECT needs of offsets, lengths and addresses on any device


def disk_baseline(
    directory: Path,
    sources: np.ndarray[Any, Any],
    count: int,
    *,
    writers: int,
    readers: int,
    cold: bool,
    direct: bool = False,
) -> tuple[float, float]:
    """Raw write+fsync of ``count`` files (rows of ``sources``, in turn), then reads of them
    into preallocated buffers.

    ``writers`` threads write (the tier's write workers, so both sides get the same I/O
    parallelism) and ``readers`` threads read (the bench's concurrency). The read buffers
    rotate over as many rows as ``sources`` has: the store reads into pool slabs spread over
    its staging memory, not into one buffer that stays in the CPU cache.
    """
    directory.mkdir(parents=True, exist_ok=True)
    slots, size = (int(n) for n in sources.shape)
    paths = [directory / f"baseline-{i}" for i in range(count)]
    if direct:
        sources = page_aligned_rows(sources)[:, :size]
    write_one = write_direct_fsynced if direct else write_fsynced

    def write(i: int) -> None:
        write_one(paths[i], sources[i % slots].data)

    warm_free_memory(size * count)
    start = time.perf_counter()
    with ThreadPoolExecutor(max(1, writers)) as pool:
        list(pool.map(write, range(count)))
    put = size * count / (time.perf_counter() - start) / 1e9
    if cold:
        drop_page_cache(paths)
    if direct:  # O_DIRECT reads whole blocks into aligned memory
        bufs = _aligned_rows(slots, size, populate=True)
    else:
        bufs = np.ones((slots, size), dtype=np.uint8)  # ones(): every page touched up front

    def read(i: int) -> None:
        if direct:
            read_direct(paths[i], bufs[i % slots].data)
            return
        with open(paths[i], "rb", buffering=0) as f:
            f.readinto(bufs[i % slots].data)

    start = time.perf_counter()
    with ThreadPoolExecutor(max(1, readers)) as pool:
        list(pool.map(read, range(count)))
    get = size * count / (time.perf_counter() - start) / 1e9
    for p in paths:
        p.unlink()
    settle_disk()
    return put, get


def page_aligned_rows(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """A copy of a 2-D uint8 array whose rows start on pages and are padded with zeros to a
    block multiple (O_DIRECT needs aligned memory and lengths). Zero-filled and in huge pages,
    like the pool of a store with a direct_io tier (``host_memory``): O_DIRECT speed depends
    on it."""
    rows, size = array.shape
    out = _aligned_rows(rows, size, populate=False)  # the copy below touches every page
    out[:, :size] = array
    return out


def _aligned_rows(rows: int, size: int, *, populate: bool) -> np.ndarray[Any, Any]:
    """Zero-filled rows of ``size`` bytes padded to a block multiple, each starting on a page,
    in huge pages."""
    padded = size + (-size % DIO_ALIGN)
    memory = anonymous_memory(rows * padded, populate=populate, huge_pages=True)
    out: np.ndarray[Any, Any] = np.frombuffer(memory, dtype=np.uint8)[: rows * padded]
    return out.reshape(rows, padded)


def write_fsynced(path: Path, data: memoryview) -> None:
    """The raw way to store bytes durably: write them all to a new file, then fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = data
        while view.nbytes:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def write_direct_fsynced(path: Path, data: memoryview) -> None:
    """The same with O_DIRECT: the whole blocks straight from ``data`` (page-aligned), the
    last partial block padded in a page of its own, the file then cut to size and fsynced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        full = data.nbytes - data.nbytes % DIO_ALIGN
        pos = 0
        while pos < full:
            pos += os.pwrite(fd, data[pos:full], pos)
        if full < data.nbytes:
            with mmap.mmap(-1, DIO_ALIGN) as block:
                block[: data.nbytes - full] = data[full:]
                os.pwrite(fd, block, full)
            os.ftruncate(fd, data.nbytes)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_direct(path: Path, buf: memoryview) -> None:
    """Read a whole file with O_DIRECT into ``buf`` (page-aligned, a block multiple long)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        got = 0
        while (n := os.preadv(fd, [buf[got:]], got)) > 0:
            got += n
    finally:
        os.close(fd)


WARM_MEMORY_CAP = 4 << 30  # 1.5 times a 2 GiB phase (the default bench: 64 x 32 MiB), and some


def warm_free_memory(nbytes: int) -> None:
    """Touch and free 1.5 times ``nbytes`` (at most WARM_MEMORY_CAP) of memory, right before a
    timed write phase of ``nbytes``, so that the page cache that phase fills takes pages the
    guest has just used.

    Why: in a VM with free page reporting (this machine's), memory left free for a second or
    two goes back to the host, and the next write into the page cache pays to fault it in
    again: buffered writes of 1 GiB ran at a median 0.92 GB/s after 2.5 s idle, 1.87 with
    1.2 GiB touched and freed first, and 1.98 with O_DIRECT, which takes no page cache
    (``benchmarks/disk_effects.py --only warm_memory --rounds 6``). Which phase found such
    pages was chance (the baseline right after the store had freed its memory did), so both
    sides' write phases now start from the same state. Half as much again as the phase needs
    is a margin, not a measured optimum: ``disk_effects.py --only warm_sizes --rounds 4`` gave
    medians of 1.23 GB/s with 0.75x, 1.79 with 1x and 1.87 with 1.5x (slowest rounds 1.33 and
    1.68 for the last two, a difference within this disk's noise over 4 rounds).
    """
    n = min(nbytes * 3 // 2, WARM_MEMORY_CAP)
    if n > 0:
        np.ones(n, dtype=np.uint8)  # ones(): every page faulted in; freed on return


def settle_disk() -> None:
    """Flush what the previous phase left pending (dirty pages, the journal commits and
    discards of its deletes on a disk mounted with ``discard``), so that every phase starts
    from the same state instead of paying for the one before."""
    os.sync()


def drop_page_cache(paths: Iterable[Path]) -> None:
    """Evict files' clean pages so that the next read comes from the disk."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
