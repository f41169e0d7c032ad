"""The disk tier's index, saved when the connector closes cleanly and read back at the next
start instead of reading every record's header.

A start used to scan every file: at a million objects 40 s to 4 minutes here, the disk reading
each header. A clean close now writes ``index`` in the root (keys in eviction order, so the
next start also keeps the LRU order a scan would rebuild from write times), and the next start
reads it. Trusting it is safe only if nothing changed in between, so:

- the start removes it (and syncs the root) before building the index from it: after a crash
  the next start finds no snapshot and scans, whatever this run changed;
- it is written after a sync of the file system (so that no rename or unlink it describes can
  be lost in a power loss while it survives) to ``index.tmp``, synced and renamed, so a torn
  write leaves no ``index``;
- its last 8 bytes are the xxh3-64 of the rest: a damaged or truncated one is refused (logged)
  and the directory scanned.

A file removed by hand between close and start stays in the index until a read misses it (the
read then forgets it, as for any unreadable record); one copied in by hand is not seen until a
scan: delete ``index`` to force one.

Layout (little-endian)::

    magic b"KVGIDX01", count u64
    count times: key_len u32, data_len u64, phase u16 (NO_PHASE: none), key (UTF-8)
    xxh3_64 of everything above, u64

All of this blocks; the connector runs it in a worker thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import stat
import struct
from collections.abc import Iterable
from typing import NamedTuple

import xxhash

NAME = "index"
_TMP = "index.tmp"
MAGIC = b"KVGIDX01"
_HEAD = struct.Struct("<8sQ")
_ENTRY = struct.Struct("<IQH")
_DIGEST = struct.Struct("<Q")
NO_PHASE = 0xFFFF
_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC


class Entry(NamedTuple):
    key: str
    data_len: int
    phase: int | None  # where in a page a padded record's data starts (see the connector)


class BadSnapshot(Exception):
    """The snapshot is damaged, truncated or not one."""


def encode(entries: Iterable[Entry]) -> bytes:
    body = bytearray(_HEAD.size)
    count = 0
    for key, data_len, phase in entries:
        raw = key.encode("utf-8", "surrogatepass")
        body += _ENTRY.pack(len(raw), data_len, NO_PHASE if phase is None else phase)
        body += raw
        count += 1
    _HEAD.pack_into(body, 0, MAGIC, count)
    body += _DIGEST.pack(xxhash.xxh3_64_intdigest(body))
    return bytes(body)


def decode(data: bytes) -> list[Entry]:
    """The entries, in the order they were saved; BadSnapshot if anything is off."""
    if len(data) < _HEAD.size + _DIGEST.size:
        raise BadSnapshot(f"{len(data)} bytes is too short")
    (digest,) = _DIGEST.unpack_from(data, len(data) - _DIGEST.size)
    body = memoryview(data)[: len(data) - _DIGEST.size]
    if xxhash.xxh3_64_intdigest(body) != digest:
        raise BadSnapshot("checksum mismatch")
    magic, count = _HEAD.unpack_from(body)
    if magic != MAGIC:
        raise BadSnapshot(f"magic {magic!r}")
    entries: list[Entry] = []
    at, end, step = _HEAD.size, len(body), _ENTRY.size
    unpack = _ENTRY.unpack_from
    try:
        for _ in range(count):
            key_len, data_len, phase = unpack(body, at)
            at += step
            key = bytes(body[at : at + key_len]).decode("utf-8", "surrogatepass")
            at += key_len
            entries.append(Entry(key, data_len, None if phase == NO_PHASE else phase))
    except (struct.error, UnicodeDecodeError) as exc:
        raise BadSnapshot(f"entry {len(entries)}: {exc}") from exc
    if at != end:
        raise BadSnapshot(f"{end - at} bytes after {count} entries")
    return entries


def take(root_fd: int) -> bytes | None:
    """The saved snapshot's bytes, removed from the root before they are read (see the
    module's notes); None if there is none, or a link or non-file in its place (removed too).

    Raises BadSnapshot if it cannot be read (it is gone by then: the directory is scanned),
    and OSError if it cannot be removed: a later start would trust it after this run changed
    the directory, so this one must not start.
    """
    with contextlib.suppress(OSError):
        os.unlink(_TMP, dir_fd=root_fd)  # a save that never finished; never read
    try:
        # O_NONBLOCK: a FIFO in its place must not hang the start.
        fd = os.open(NAME, os.O_RDONLY | os.O_NONBLOCK | _FLAGS, dir_fd=root_fd)
    except FileNotFoundError:
        return None
    except OSError:  # a link in its place (ELOOP), unreadable: removed below
        fd = -1
    try:
        os.unlink(NAME, dir_fd=root_fd)  # never follows a link: removes the link itself
        os.fsync(root_fd)
        if fd < 0 or not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        try:
            return _read_all(fd)
        except OSError as exc:
            raise BadSnapshot(f"unreadable: {exc}") from exc
    finally:
        if fd >= 0:
            os.close(fd)


def save(root_fd: int, data: bytes) -> None:
    """Write ``data`` as the root's snapshot: to a new temp file, synced, then renamed.

    The file system is synced first: renames and unlinks of objects are not each synced (only
    with ``fsync_dir``), and after a power loss the index must not be on disk while what it
    describes is not (a deleted object back as a file it does not count).
    """
    _sync_file_system(root_fd)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_TMP, dir_fd=root_fd)  # O_EXCL below: never write through a link to it
    fd = os.open(_TMP, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _FLAGS, 0o644, dir_fd=root_fd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(_TMP, dir_fd=root_fd)
        raise
    os.close(fd)
    os.rename(_TMP, NAME, src_dir_fd=root_fd, dst_dir_fd=root_fd)
    os.fsync(root_fd)


def _read_all(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    chunks = []
    while size > 0:
        chunk = os.read(fd, min(size, 64 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _sync_file_system(fd: int) -> None:
    """syncfs(2) of the file system holding ``fd``; sync(2) where libc has no syncfs."""
    syncfs = getattr(ctypes.CDLL(None, use_errno=True), "syncfs", None)
    if syncfs is None:
        os.sync()
        return
    if syncfs(fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"syncfs: {os.strerror(err)}")
