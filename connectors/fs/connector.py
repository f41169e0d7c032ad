"""``file:///abs/path`` — the disk tier: one file per object under a root directory.

Layout under the root::

    .lock                        flock(LOCK_EX | LOCK_NB) for the connector's lifetime
    index                        the index, saved at a clean close, read (and removed) at
                                 the next start instead of scanning: see snapshot.py
    objects/ab/cd/<hash>.kvo     hash = blake2b(key, digest_size=20), hex; see record.py
    tmp/                         puts in progress (removed at start: they never completed)
    quarantine/                  files found broken, kept for a human to look at

Only hex digits from a hash become path components, so no key can name a file outside the
root, and no symlink inside the root is ever followed (see dirs.py): the root itself may be
one, but a link in place of ``.lock``, ``objects/``, ``tmp/`` or ``quarantine/`` refuses the
directory at start (ConfigError), and a fan-out directory or an object file that is a link is
ignored: never read, moved or deleted, logged once per kind (fan-out directory, object file,
temp file) per connector. A put whose fan-out directory or object file is a link fails with a
ConfigError and writes nothing through it. The lock makes the root exclusive to one connector
(in this or any process): the index in memory is then the truth about what is stored, and
``exists`` needs no I/O.

put writes a temp file with ``os.writev`` (no joining of parts), fsyncs it and renames it into
place: readers see the old file or the new one, never a partial one, and a crash leaves a whole
record or none. ``fsync_dir`` (off by default) also fsyncs the directory after the rename, so
that a put that returned survives a power loss. A cache may lose its newest puts in a crash
(after a power loss, an overwritten key may come back with its previous value and a deleted
key may reappear; never a torn or foreign object: records are checked by a start that scans,
which every start after a crash is, and records and frames at every read), and each directory
fsync is one more journal commit to wait for. (Measured here with
``benchmarks/disk_effects.py --only fsync_dir --rounds 14``: medians 1.07 GB/s without it and
0.94 with it, within this disk's noise, which swings 0.6-2.2 from round to round.)
Puts and deletes of one key are serialized by a per-key lock; reads take no lock.

``direct_io`` (off by default, on in the embedded default config; LMCache's ``use_odirect``) moves
objects of DIRECT_IO_BYTES or more with O_DIRECT, so that the tier does not fill the page cache with
what the memory tier above it already caches. A put whose last part (the payload) starts on a page
(a slab of the store's staging pool) is written straight from that memory: the record is padded
(version 2, see record.py) so that the payload lands on a block boundary. Other puts (codec output,
small objects) write unpadded records through the page cache. Padded records are read with O_DIRECT:
the index keeps where in a page each one's data starts, the allocator places the buffer at that
phase (``placed``), and the disk fills its whole blocks in place; the partial blocks at either end,
or a buffer at another phase, go through a small per-thread bounce buffer. Unpadded records are read
through the page cache. A filesystem that refuses O_DIRECT (EINVAL at open, write or read) turns the
option off with a warning, and the operation is redone through the page cache. Records written with
it (version 2) are not readable by kvgate versions before it.

The index is built lazily, in a worker thread, by the first operation (or an explicit
``await connector.open()``): construction only takes the lock, so it is cheap and sync, and
``await connector.get(...)`` works right after it. The scan reads headers, not data, inserts the
keys into the eviction policy oldest first (by mtime) and evicts if over capacity.
``usage()`` is exact once the index is built and (0, capacity) before.

Capacity counts object bytes (what ``put`` was given), not headers or filesystem blocks. A put
evicts keys that no operation is using; when only objects in use could make room, it waits for
other puts in flight to finish, and fails with CapacityError if none are left to wait for.
A read that finds a broken record (after ``get_into`` may already have called ``alloc``) is a
miss; the file goes to quarantine/ and ``corrupt_files`` counts it.
A cancelled call waits for its worker thread to stop (one chunk at most) before it re-raises,
so no thread touches the caller's buffers after the call is over.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import functools
import logging
import os
import secrets
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self, TypeVar
from urllib.parse import unquote

from pydantic import Field

from connectors._options import StrictOptions, parse_options, split_url
from connectors.fs import record as rec
from connectors.fs import snapshot
from connectors.fs.dirs import Name, Symlink, Tree
from connectors.fs.keylocks import KeyLocks
from connectors.fs.read import DIRECT_IO_BYTES, read_object
from connectors.fs.record import SizeChanged
from gateway.background import low_priority_threads, pool_for
from gateway.connector import (
    Allocator,
    BaseConnector,
    as_parts,
    fill_hook,
    placement_hook,
)
from gateway.errors import CapacityError, ConfigError, CorruptRemoved, GatewayError, Unavailable
from gateway.inflight import InFlight
from gateway.policies import EvictionPolicy, make_policy
from gateway.recent_threads import RecentThreadPool
from gateway.thread_jobs import in_thread
from gateway.types import Buffer, BufferParts, Capabilities, ObjectInfo

log = logging.getLogger(__name__)
T = TypeVar("T")
_UNREADABLE = (rec.BadRecord, rec.ForeignRecord, FileNotFoundError, Symlink)
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class _Quarantined:
    """Marks a file that _check_file moved to quarantine/."""


_QUARANTINED = _Quarantined()


@dataclass
class _Built:
    """The index as the scan at start builds it."""

    policy: EvictionPolicy[str] | None  # None without a capacity, as the connector's
    index: dict[str, int] = field(default_factory=dict)  # key -> object bytes
    phases: dict[str, int] = field(default_factory=dict)  # see FileConnector._phases
    used: int = 0
    whole: bool = True  # False: the scan was stopped halfway (by close)
    quarantined: int = 0  # files the scan moved to quarantine/


class FileOptions(StrictOptions):
    capacity: int | None = Field(default=None, gt=0, description="bytes; None = unbounded")
    eviction: str = "lru"
    fsync: bool = True
    fsync_dir: bool = False
    direct_io: bool = False


# The connector's blocking work (reads, writes with their fsyncs, scans) runs in threads of
# its own, as many as asyncio's default executor would have: steady threads that the event
# loop wakes and is woken by directly (gateway.thread_jobs), shared by every file tier. The
# store's write-behind runs in a second set at a lower CPU priority (gateway.background).
def _fs_threads() -> RecentThreadPool:
    # Serial calls stay on one thread (gateway.recent_threads): 1 MiB gets from the page cache
    # took 0.29-0.30 ms a get against 0.35-0.37 rotating over the pool's threads.
    workers = min(32, (os.cpu_count() or 1) + 4)
    return RecentThreadPool(workers, thread_name_prefix="kvgate-fs")


def _fs_background_threads() -> ThreadPoolExecutor:
    return low_priority_threads(min(32, (os.cpu_count() or 1) + 4), "kvgate-fs-behind")


_FS_THREADS = _fs_threads()
_FS_BEHIND = _fs_background_threads()


def _new_fs_threads_after_fork() -> None:
    global _FS_THREADS, _FS_BEHIND  # a forked child inherits the executors but not threads
    _FS_THREADS = _fs_threads()
    _FS_BEHIND = _fs_background_threads()


os.register_at_fork(after_in_child=_new_fs_threads_after_fork)


async def _in_thread(
    fn: Callable[[threading.Event], T], on_abandon: Callable[[T], None] | None = None
) -> T:
    """``fn(stop)`` in a worker thread. On cancellation, set ``stop`` and wait for ``fn`` to
    return before re-raising: ``fn`` may be using the caller's buffers. A result that ``fn``
    produced anyway goes to ``on_abandon`` (to commit a finished write, to close a file)."""
    stop = threading.Event()
    pool = pool_for(_FS_THREADS, _FS_BEHIND)
    return await in_thread(
        pool, functools.partial(fn, stop), on_cancel=stop.set, on_abandon=on_abandon
    )


def _no_buffer(size: int) -> memoryview | None:
    return None  # get_into then reads into a new bytearray


class FileConnector(BaseConnector):
    scheme: ClassVar[str] = "file"

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        capacity: int | None = None,
        eviction: str = "lru",
        fsync: bool = True,
        fsync_dir: bool = False,
        direct_io: bool = False,
    ) -> None:
        if capacity is not None and capacity <= 0:
            raise ConfigError(f"file:// capacity must be > 0 bytes, got {capacity}")
        self.root = os.path.abspath(os.fspath(root))
        self.capacity = capacity
        self.fsync = fsync
        self.fsync_dir = fsync_dir
        self.direct_io = direct_io
        self.capabilities = Capabilities(  # batch: exists_many reads the index in memory
            batch=True, list=True, zero_copy=True, persistent=True, max_object_size=capacity
        )
        self._eviction = eviction
        policy = make_policy(eviction, capacity or 0)  # checks the name even without capacity
        self._policy: EvictionPolicy[str] | None = policy if capacity is not None else None
        self._objects = os.path.join(self.root, "objects")
        self._tree = Tree(self.root)
        # Closing the tree's fds drops the lock: on close(), or when a connector nobody closed
        # is garbage collected, so that a forgotten instance does not lock the root for good.
        self._unlock = weakref.finalize(self, self._tree.close)
        self._links_logged: set[str] = set()
        self._index: dict[str, int] | None = None  # key -> object bytes; None until scanned
        # key -> where in a page its data starts in the file: a direct read asks the allocator
        # for a buffer at that phase, so the disk fills it in place (a hint only: a read that
        # finds another phase goes through its bounce buffer)
        self._phases: dict[str, int] = {}
        # The index's scan, once started (see _ready).
        self._scanning: asyncio.Future[dict[str, int]] | None = None
        self._closing: asyncio.Future[None] | None = None
        # A file the index forgot but could not remove (an unlink failed): the index no longer
        # tells the whole truth, so close saves none and the next start scans.
        self._diverged = False
        self._keys = KeyLocks()
        self._used = 0  # bytes of committed objects
        self._reserved = 0  # bytes promised to puts in flight (see _make_room)
        self._room = asyncio.Event()  # set when a reservation ends
        self._in_flight = InFlight()
        self._closed = False
        self.corrupt_files = 0
        """Files found broken (bad record header, short) and moved to quarantine/."""

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Self:
        parts = split_url(url, cls.scheme)
        path = unquote(parts.path)
        if parts.netloc not in ("", "localhost") or not os.path.isabs(path):
            raise ConfigError(f"{url!r}: file:// needs an absolute path, e.g. file:///var/kvgate")
        opts = parse_options(FileOptions, url, options)
        return cls(path, **opts.model_dump())

    def __repr__(self) -> str:
        return f"FileConnector(file://{self.root})"

    def path_for(self, key: str) -> str:
        """The file that holds (or would hold) ``key``."""
        return self._tree.path(*self._name(key))

    @staticmethod
    def _name(key: str) -> Name:
        name = rec.object_name(key)
        # Hex names cannot climb out of objects/; checked anyway, since it is the promise.
        assert all(part and os.sep not in part and part not in (".", "..") for part in name)
        return name

    def _skip_link(self, link: Symlink) -> None:
        """Log a link that was ignored, once per kind (a tree of them would flood the log)."""
        if link.kind not in self._links_logged:
            self._links_logged.add(link.kind)
            log.warning(
                "%r: ignored %s, a symlink (as %s): file:// never follows links inside its "
                "directory; further symlinks of this kind are ignored silently",
                self,
                link.path,
                link.kind,
            )

    # -- lifecycle ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _op(self) -> Iterator[None]:
        """Count an operation in flight, so that close() can wait for it."""
        if self._closed:
            raise GatewayError(f"{self!r} is closed")
        with self._in_flight.track():
            yield

    async def open(self) -> None:
        """Build the index (once); every operation calls this first."""
        if self._closed:
            raise GatewayError(f"{self!r} is closed")
        await self._ready()

    async def _ready(self) -> dict[str, int]:
        if self._index is not None:
            return self._index
        # One scan, owned by the connector and shielded from the operation that started it:
        # that operation's timeout (5 s by default) used to cancel it, and the next operation
        # began again from nothing, so a tier whose scan outlasts a timeout (a million objects
        # take 40 s to 4 minutes) never opened. Now operations time out while it scans, and
        # the first one after it finishes finds the index.
        scan = self._scanning
        if scan is None or (scan.done() and (scan.cancelled() or scan.exception() is not None)):
            scan = self._scanning = asyncio.ensure_future(self._build_index())
        return await asyncio.shield(scan)

    async def _build_index(self) -> dict[str, int]:
        try:
            # A whole index built when close cancelled this is still published, so that close
            # saves it again (the start removed the saved one): see _scan.
            built = await _in_thread(self._scan, on_abandon=self._publish)
        except OSError as exc:
            raise Unavailable(f"{self!r}: cannot scan {self._objects}: {exc}") from exc
        self._publish(built)
        index = self._index
        assert index is not None  # a scan that was not stopped is whole
        await self._make_room(0)  # the capacity may be smaller than last time
        return index

    def _publish(self, built: _Built) -> None:
        """Make a whole index the connector's, in one step on the loop (filling it there took
        4 + 3.5 s of CPU at a million objects, so the worker thread builds it); an index the
        scan left halfway is dropped."""
        if built.whole:
            self.corrupt_files += built.quarantined
            self._phases, self._used, self._policy = built.phases, built.used, built.policy
            self._index = built.index

    def _scan(self, stop: threading.Event) -> _Built:
        """Remove stale temp files, then build the index (in the worker thread: see _ready):
        from the snapshot the last clean close saved (snapshot.py), else by reading every
        record header and quarantining what is broken. A scan that ``stop`` ends halfway
        returns an index that is not ``whole``.
        """
        self._tree.clear_tmp(self._skip_link)  # the lock says no put of ours is running
        saved = self._saved_index()
        if saved is not None:
            return self._build(saved)
        found, quarantined = [], 0
        for leaf, name in self._tree.walk(self._skip_link):
            if stop.is_set():  # closed while scanning: this index will not be used
                return _Built(None, whole=False)
            try:
                record = self._check_file(leaf, name)
            except Symlink as link:  # became one since the listing
                self._skip_link(link)
                continue
            if isinstance(record, rec.Record):
                found.append(record)
            quarantined += record is _QUARANTINED
        found.sort(key=lambda r: (r.mtime_ns, r.key))  # oldest first: the policy's order
        entries = (
            snapshot.Entry(r.key, r.data_len, r.data_offset % rec.DIO_ALIGN if r.pad else None)
            for r in found
        )
        built = self._build(entries)
        built.quarantined = quarantined
        return built

    def _build(self, entries: Iterable[snapshot.Entry]) -> _Built:
        """The index of ``entries``, given first to evict first."""
        policy = None if self._policy is None else make_policy(self._eviction, self.capacity or 0)
        built = _Built(policy)
        for key, data_len, phase in entries:
            built.index[key] = data_len
            if phase is not None:
                built.phases[key] = phase
            built.used += data_len
            if policy is not None:
                policy.insert(key, data_len)
        return built

    def _saved_index(self) -> list[snapshot.Entry] | None:
        """The entries the last clean close saved, if it did and they are whole; the saved
        file is removed either way (see snapshot.py)."""
        try:
            data = snapshot.take(self._tree.root_fd)  # an OSError stops the start (see take)
            return None if data is None else snapshot.decode(data)
        except snapshot.BadSnapshot as exc:
            log.warning("%r: index snapshot not used (%s); scanning every record", self, exc)
            return None

    def _save_index(self) -> None:
        """Save the index for the next start (at close, when nothing else runs)."""
        index = self._index
        assert index is not None
        order = index if self._policy is None else self._policy.keys_in_eviction_order()
        entries = (snapshot.Entry(k, index[k], self._phases.get(k)) for k in order)
        snapshot.save(self._tree.root_fd, snapshot.encode(entries))

    def _check_file(self, leaf: int, name: Name) -> rec.Record | _Quarantined | None:
        """The record ``name`` (in the directory open as ``leaf``) if it is whole and named
        right; None if there is no file; else the file is moved to quarantine/ (and
        _QUARANTINED returned). Raises Symlink for a link, which stays where it is."""
        try:
            fd = self._tree.open_file(leaf, name)
        except FileNotFoundError:
            return None
        try:
            record = rec.read_record(fd)
        except rec.BadRecord as exc:
            return self._quarantine_file(leaf, name, str(exc))
        finally:
            os.close(fd)
        if self._name(record.key) != name:  # not where its key belongs: moved by hand
            return self._quarantine_file(leaf, name, f"holds key {record.key!r}, not its own")
        return record

    def _quarantine_file(self, leaf: int, name: Name, why: str) -> _Quarantined | None:
        dest = self._tree.quarantine_file(leaf, name)
        if dest is None:
            return None
        log.warning("%r: quarantined %s (%s) as %s", self, self._tree.path(*name), why, dest)
        return _QUARANTINED

    async def close(self) -> None:
        """Wait for operations in flight, stop a scan still running, save the index for the
        next start, then release the directory lock. Idempotent; every call waits for the
        same closing, which a cancelled call (a timeout) does not stop halfway."""
        self._closed = True
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close_once())
        await asyncio.shield(self._closing)

    async def _close_once(self) -> None:
        try:
            await self._in_flight.wait_idle()
            scan = self._scanning
            if scan is not None and not scan.done():
                scan.cancel()  # the scan sees its stop flag between files
                await asyncio.wait({scan})
            if scan is not None and not scan.cancelled():
                scan.exception()  # retrieved: operations reported it already
            if self._index is not None and not self._diverged:
                await _in_thread(lambda stop: self._save_index())
        except Exception as exc:  # a full disk, a scan that failed: the next start scans
            log.warning("%r: index snapshot not saved (the next start scans): %s", self, exc)
        finally:
            self._unlock()  # runs once; later calls do nothing

    # -- reads ----------------------------------------------------------------------------

    async def get(self, key: str) -> Buffer | None:
        return await self.get_into(key, _no_buffer)

    async def get_into(self, key: str, alloc: Allocator) -> memoryview | None:
        """Read the object straight into ``alloc(size)`` (a new bytearray if alloc says no).

        The size comes from the index, so the buffer is ready before the file is opened and
        the whole read is one job in a worker thread.
        """
        with self._op():
            size = (await self._ready()).get(key)
            if size is None:
                return None
            opener = functools.partial(self._tree.open_object, self._name(key))
            # Only padded records are read with O_DIRECT: their payload starts on a block, so a
            # buffer placed at the data's phase also keeps the payload aligned in memory.
            phase = self._phases.get(key)
            direct = self.direct_io and size >= DIRECT_IO_BYTES and phase is not None
            place = placement_hook(alloc) if direct else None
            replaced = 0
            try:
                while True:
                    given = place(size, phase or 0) if place else alloc(size)
                    buf = memoryview(bytearray(size)) if given is None else given.cast("B")
                    if buf.nbytes != size:
                        raise ValueError(f"alloc({size}) gave {buf.nbytes} bytes")
                    filled = fill_hook(alloc) if given is not None else None
                    try:
                        await _in_thread(
                            functools.partial(
                                read_object, opener, key, buf, filled, direct=direct, phase=phase
                            )
                        )
                        break
                    except SizeChanged as changed:  # another record now: no phase known
                        size, direct, place = changed.size, False, None
                        replaced += 1
                        if replaced == 2:  # replaced twice while we read: a miss now
                            return None
                    except OSError as exc:
                        if not (direct and exc.errno == errno.EINVAL):
                            raise
                        self._refuse_direct("a read")  # then read it again, buffered
                        direct, place = False, None
            except _UNREADABLE:
                if await self._forget_unreadable(key):
                    raise CorruptRemoved(
                        f"{self!r}: the file of {key!r} was not a whole record of it "
                        "(moved to quarantine/)"
                    ) from None
                return None
            except OSError as exc:
                raise Unavailable(f"{self!r}: reading {key!r}: {exc}") from exc
            self._touch(key)
            return given if given is not None else buf

    def _touch(self, key: str) -> None:
        if self._policy is not None and self._index is not None and key in self._index:
            self._policy.touch(key)

    async def _forget_unreadable(self, key: str) -> bool:
        """A read failed: look again under the key's lock, and drop the key if it is gone.
        True when the file was broken (it is quarantined now): the store counts that as a
        corrupt object, not a plain miss.

        A put may have replaced the file since the read, hence the second look; a broken file
        is quarantined, another key's file (a hash collision) is left alone.
        """
        name = self._name(key)
        async with self._keys.hold(key):
            try:
                found = await _in_thread(lambda stop: self._recheck(name))
            except OSError as exc:
                raise Unavailable(f"{self!r}: checking {self.path_for(key)}: {exc}") from exc
            if found is _QUARANTINED:
                self.corrupt_files += 1
            if not (isinstance(found, rec.Record) and found.key == key):
                self._forget(key)
            return found is _QUARANTINED

    def _recheck(self, name: Name) -> rec.Record | _Quarantined | None:
        """_check_file of ``name``, where a link (on the way or in its place) counts as no file."""
        try:
            leaf = self._tree.open_leaf(name[0], name[1])
            if leaf is None:
                return None
            try:
                return self._check_file(leaf, name)
            finally:
                os.close(leaf)
        except Symlink as link:
            self._skip_link(link)
            return None

    def _forget(self, key: str) -> None:
        assert self._index is not None
        size = self._index.pop(key, None)
        self._phases.pop(key, None)
        if size is not None:
            self._used -= size
            if self._policy is not None:
                self._policy.remove(key)

    async def exists(self, key: str) -> bool:
        with self._op():
            return key in await self._ready()

    async def exists_many(self, keys: Sequence[str]) -> list[bool]:
        with self._op():
            index = await self._ready()
            return [key in index for key in keys]

    async def ping(self) -> bool:
        with self._op():
            await self._ready()
            try:
                await asyncio.to_thread(os.stat, self._objects)
                if self._tree.removed() is not None:  # one made again there is not this tier's
                    raise FileNotFoundError(errno.ENOENT, "the tier's directory was removed")
            except OSError as exc:
                raise self._unavailable("ping", exc) from exc
            return True

    def _unavailable(self, what: str, exc: OSError) -> Unavailable:
        """``exc`` as the tier's error; one that a removed directory explains says so (the
        bare error names a fan-out folder, ``'88'``, relative to a directory now gone)."""
        gone = self._tree.removed() if exc.errno == errno.ENOENT else None
        if gone is not None:
            return Unavailable(
                f"{self!r}: {gone} was removed while in use, so nothing can be stored or read "
                f"there until kvgate restarts (it then starts empty); {what}: {exc}"
            )
        return Unavailable(f"{self!r}: {what}: {exc}")

    def usage(self) -> tuple[int, int | None]:
        return (self._used, self.capacity)

    # -- writes ---------------------------------------------------------------------------

    async def put(self, key: str, data: BufferParts) -> None:
        parts = as_parts(data)
        size = sum(p.nbytes for p in parts)
        if self.capacity is not None and size > self.capacity:
            raise CapacityError(
                f"{self!r}: object of {size} bytes is larger than the capacity ({self.capacity})"
            )
        with self._op():
            index = await self._ready()
            name = self._name(key)
            head, body, data_offset = self._layout(key, size, parts)
            phase = data_offset % rec.DIO_ALIGN if body is not None else None
            async with self._keys.hold(key):
                reservation = await self._make_room(size - index.get(key, 0))
                try:
                    fsync_error = await _in_thread(
                        lambda stop: self._write(name, head, body, stop),
                        lambda _: self._commit(key, size, phase),
                    )
                    self._commit(key, size, phase)
                except Symlink as link:
                    raise ConfigError(
                        f"{self!r}: cannot put {key!r}: {link.path} is a symlink, and file:// "
                        "never writes through links inside its directory; remove it"
                    ) from None
                except OSError as exc:
                    if exc.errno in _DISK_FULL:
                        raise CapacityError(f"{self!r}: disk full writing {size} bytes") from exc
                    raise self._unavailable(f"writing {key!r}", exc) from exc
                finally:
                    self._release(reservation)
                if fsync_error is not None:
                    raise Unavailable(
                        f"{self!r}: fsync of {self.path_for(key)}'s directory: {fsync_error}"
                    )

    def _layout(
        self, key: str, size: int, parts: list[memoryview]
    ) -> tuple[list[memoryview], memoryview | None, int]:
        """(everything before the body, the body to write with O_DIRECT or None, where the
        data starts in the file).

        With ``direct_io``, a large last part at a page-aligned address (a staged object's
        slab) becomes the body: the record is padded so that it starts on a block boundary.
        Anything else is written through the page cache, as one list of parts.
        """
        if self.direct_io and parts and parts[-1].nbytes >= DIRECT_IO_BYTES:
            body = parts[-1]
            if rec.is_aligned(body):
                head_len = rec.HEADER_LEN + len(rec.encode_key(key))
                pad = rec.pad_for(head_len, size - body.nbytes)
                head = memoryview(rec.pack_head(key, size, pad))
                return [head, memoryview(bytes(pad)), *parts[:-1]], body, head.nbytes + pad
        head = memoryview(rec.pack_head(key, size))
        return [head, *parts], None, head.nbytes

    def _write(
        self,
        name: Name,
        lead: Sequence[memoryview],
        body: memoryview | None,
        stop: threading.Event,
    ) -> OSError | None:
        """Write a temp file and rename it to ``name``'s place. Returns a failed directory
        fsync (the object is in place by then, so the caller commits it and reports the
        error). Raises Symlink, having written nothing, where a link is on the way."""
        if stop.is_set():
            raise rec.Stopped
        leaf = self._tree.open_leaf(name[0], name[1], create=True, fsync=self.fsync_dir)
        assert leaf is not None
        try:
            self._tree.check_not_link(leaf, name)  # fail before writing, not at the rename
            tmp = f"{name[2]}.{secrets.token_hex(8)}"
            fd = self._open_for_write(tmp, direct=body is not None)
            try:
                try:
                    if body is not None and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
                        self._write_direct(fd, lead, body, stop)
                    else:
                        rec.write_all(fd, [*lead, *([] if body is None else [body])], stop)
                    if stop.is_set():  # no need to make durable what will not be kept
                        raise rec.Stopped
                    if self.fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                if stop.is_set():  # cancelled: a cancelled put should not take effect
                    raise rec.Stopped
                self._tree.commit_tmp(tmp, leaf, name)
            except BaseException:
                self._tree.unlink_tmp(tmp)
                raise
            if self.fsync_dir:
                try:
                    os.fsync(leaf)
                except OSError as exc:
                    return exc
            return None
        finally:
            os.close(leaf)

    def _open_for_write(self, tmp: str, *, direct: bool) -> int:
        """Create the temp file, with O_DIRECT when asked and the filesystem takes it (else
        buffered, and direct_io is switched off: it would fail every time)."""
        if direct and self.direct_io:
            try:
                return self._tree.open_tmp(tmp, os.O_WRONLY | os.O_DIRECT)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._tree.unlink_tmp(tmp)  # Linux creates the file before it refuses O_DIRECT
                self._refuse_direct("an open")
        return self._tree.open_tmp(tmp, os.O_WRONLY)

    def _write_direct(
        self, fd: int, lead: Sequence[memoryview], body: memoryview, stop: threading.Event
    ) -> None:
        """write_direct, or, where the filesystem took O_DIRECT at open but refuses its writes
        (an alignment larger than a page), the same bytes again through the page cache."""
        try:
            rec.write_direct(fd, lead, body, stop)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self._refuse_direct("a write")
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            os.ftruncate(fd, 0)
            rec.write_all(fd, [*lead, body], stop)  # from offset 0: direct writes use pwrite

    def _refuse_direct(self, what: str) -> None:
        if self.direct_io:
            self.direct_io = False
            log.warning("%r: the filesystem refused O_DIRECT (%s); direct_io is off", self, what)

    def _commit(self, key: str, size: int, phase: int | None) -> None:
        """Index a written record; ``phase`` is its data's, if it was padded for O_DIRECT."""
        assert self._index is not None
        self._used += size - self._index.get(key, 0)
        self._index[key] = size
        if phase is None:
            self._phases.pop(key, None)
        else:
            self._phases[key] = phase
        if self._policy is not None:
            self._policy.insert(key, size)

    async def _make_room(self, grow: int) -> int:
        """Evict until ``grow`` more bytes fit; returns the bytes reserved for them.

        A put reserves only its growth (new size - old size of its key, which it holds: the
        rename frees the old size); reservations keep concurrent puts of other keys from
        overshooting together. Keys with an operation in flight are never victims. When the
        room is taken by other puts' reservations, wait for one to end and look again; when
        nothing is reserved and still nothing can go, the object does not fit now.
        """
        if self._policy is None or self.capacity is None or self._index is None:
            return 0
        while True:
            victims = []
            while self._used + self._reserved + grow > self.capacity:
                victim = self._policy.victim(lambda k: not self._keys.busy(k))
                if victim is None:
                    break
                victims.append(victim)
                self._used -= self._index.pop(victim, 0)
                self._phases.pop(victim, None)
            fits = self._used + self._reserved + grow <= self.capacity
            reservation = max(grow, 0) if fits else 0
            self._reserved += reservation
            try:
                if victims:
                    names = [self._name(v) for v in victims]
                    async with self._keys.hold(*victims):  # no put of a victim until it is gone
                        await _in_thread(functools.partial(self._remove_all, names))
                    if not fits:
                        continue  # things moved while we unlinked: look again
                if fits:
                    return reservation
                if self._reserved == 0:
                    raise CapacityError(
                        f"{self!r}: no room for {grow} more bytes: every object that could go "
                        "is in use by an operation in flight"
                    )
                # No await between the check above and this wait, so no wake-up is missed.
                self._room.clear()
                await self._room.wait()
            except BaseException:
                self._release(reservation)
                raise

    def _remove_all(self, names: Sequence[Name], stop: threading.Event) -> None:
        for name in names:  # short work: no need to stop halfway
            self._remove(name)

    def _remove(self, name: Name) -> None:
        try:
            self._tree.remove_object(name)
        except Symlink as link:
            self._skip_link(link)
        except OSError:
            self._diverged = True  # see __init__
            raise

    def _release(self, reservation: int) -> None:
        self._reserved -= reservation
        self._room.set()  # wake puts waiting in _make_room

    async def delete(self, key: str) -> bool:
        with self._op():
            index = await self._ready()
            async with self._keys.hold(key):
                if key not in index:
                    return False
                self._forget(key)
                name = self._name(key)
                try:
                    await _in_thread(lambda stop: self._remove(name))
                except OSError as exc:
                    raise Unavailable(f"{self!r}: deleting {key!r}: {exc}") from exc
                return True

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        with self._op():
            index = await self._ready()
            # A snapshot, not sorted: listings keep their own order (``gateway.listing``), and
            # sorting a 1M-object index on every page cost more than scanning it.
            snapshot = [(k, n) for k, n in index.items() if k.startswith(prefix)]
        for key, size in snapshot:
            yield ObjectInfo(key, size)
