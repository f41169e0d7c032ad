"""glibc's malloc thresholds for a process that moves MiB-sized buffers.

**The problem.** glibc's malloc serves a request of 128 KiB or more with a fresh ``mmap`` until
a buffer that large is freed; it then raises that threshold to the freed size and its trim
threshold to twice that, and serves such sizes from its heap. After the first 1 MiB buffer is
freed, the trim threshold is 2 MiB: two 1 MiB buffers freed together leave more than that at
the top of the heap, glibc gives the memory back to the kernel, and the next two buffers fault
their 512 pages in again. Measured here (scratch script, 200 rounds of two 1 MiB ``bytes``
made and dropped in one thread): 480 page faults a round, and none with the thresholds below.
A Valkey put does exactly this (glide copies the value that the connector joined: 478 faults
and about 1 ms more CPU per 1 MiB put than a ``SET`` of an existing ``bytes``).

**The fix.** Set the thresholds where glibc's own raising of them ends for a process that has
freed a 32 MiB buffer: requests up to 32 MiB (``DEFAULT_MMAP_THRESHOLD_MAX`` on 64-bit) from
the heap, and up to 64 MiB of free memory kept at the top of each heap. A process that handles
32 MiB KV chunks gets there on its own after its first freed chunk; setting it at start makes
it so from the first put, whatever sizes come first. Memory: each malloc arena may keep up to
64 MiB that it would otherwise have given back; kvgate's large buffers (the store's pool) are
its own mappings and do not count.

``kvgate`` commands call ``steady_malloc_thresholds`` at start (``gateway.cli.app``). A program
that embeds a Store may call it too. It changes nothing where the user set glibc's thresholds
(``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``GLIBC_TUNABLES``), where
``KVGATE_MALLOC_THRESHOLDS`` is ``glibc`` (or ``off``, ``0``, ``false``, ``no``), or on another
C library.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Mapping

MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD
# mallopt's parameter numbers (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
_TUNABLES = ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold")
OPT_OUT = "KVGATE_MALLOC_THRESHOLDS"
_LEAVE = frozenset({"glibc", "off", "0", "false", "no"})  # values of OPT_OUT that opt out


def user_chose_thresholds(env: Mapping[str, str]) -> bool:
    """Whether ``env`` sets glibc's thresholds itself, or asks kvgate to leave them."""
    if env.get(OPT_OUT, "").strip().lower() in _LEAVE:
        return True
    if any(name in env for name in _USER_SETTINGS):
        return True
    tunables = env.get("GLIBC_TUNABLES", "")
    return any(name in tunables for name in _TUNABLES)


def steady_malloc_thresholds(env: Mapping[str, str] | None = None) -> bool:
    """Set glibc's mmap and trim thresholds (module docs); True when they were set."""
    if user_chose_thresholds(os.environ if env is None else env):
        return False
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # mallopt answers 1 on success; the mmap threshold first: it is the one that matters.
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
