"""Large objects as parts on key-value servers, committed atomically by one final write.

Redis, Valkey and memcached move a 32 MiB value several times slower than eight 4 MiB values
sent in parallel over several connections, and memcached cannot hold one above its item limit.
So connectors for such servers store a large object as parts and commit it with one last write
of its main key. ``StripedObjects`` is that algorithm, written once; a connector provides the
few primitive operations of its server (``PartBackend``).

On the server, for an object under main key ``K``:

- up to ``inline_max`` bytes: ``K = b"\\x00" + data`` (one value, atomic by itself);
- larger: parts ``P(gen, i)`` hold consecutive ``part_size`` slices, then
  ``K = b"\\x01" + manifest(gen, total, part_size, count)`` is written last: the commit.

Why readers never see a wrong object:

- a reader first reads ``K``; before the commit it sees the old object (or a miss);
- every write draws a fresh random ``gen``, so part keys are never shared between writes and a
  manifest names exactly the parts of its own write: mixing two writes is impossible;
- every part must come back with exactly its expected length, else the whole read fails: the
  main key is read again and, if a later overwrite committed meanwhile (and deleted these
  parts), its object is read instead; the same manifest again (a part evicted by the server,
  or expired) is a miss.

Why a forged manifest costs nothing (anyone who can write to the server can write one): it is
checked before anything is allocated or requested. Its part count must agree with its total
and part size and stay within ``MAX_PARTS`` (``put`` never writes more); its part size must be
one the connector could have been configured with (``min_part_size``); its total must be
within ``read_limit()``, what the reading Store accepts as one object. A manifest that fails a
check is a ``CorruptObject``. Parts are then read by at most ``limit`` workers that take the
next part (``bounded_all``), never a task per part, and the first missing part ends the read.

Parts are written with a "pending" TTL, so that the parts of a write that dies before its commit
expire by themselves. After the commit they are made durable (no TTL, or the object's TTL plus
the pending margin). A crash between the commit and that step leaves an object whose parts
later expire: it becomes a miss, never wrong. The commit swaps ``K`` and returns the value it
replaced; when that was a manifest, the superseded parts are deleted (each old manifest is
returned by exactly one swap, so concurrent writers clean up after each other exactly once).

Superseded parts have no TTL any more (their own commit made them durable), so a removal of
them that fails (a connection reset part-way) would leave them for ever: their keys are kept
in memory (``ORPHANS_KEPT`` at most) and removed with the next removal or after the next
commit. The parts of a failed write are removed at once and kept for one more removal: a
part whose request was cut short by the failure can still land after the first one (they
would expire by their pending TTL, an hour by default, on a server that may be full).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import struct
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar, overload

from gateway.connector import Allocator, as_parts, read_limit
from gateway.errors import CapacityError, CorruptObject, ForeignObject, OverReadLimit
from gateway.host_memory import anonymous_memory
from gateway.types import Buffer, BufferParts

INLINE = 0
MANIFEST = 1
_MANIFEST = struct.Struct("<4sB16sQQI")
_log = logging.getLogger(__name__)
ORPHANS_KEPT = 1 << 16  # part keys kept for another removal; past it the oldest are forgotten
ORPHANS_PER_REMOVAL = 4096  # of those, sent with one removal
_MAGIC = b"KVGP"
_VERSION = 1
MANIFEST_SIZE = 1 + _MANIFEST.size
"""Bytes of a stored manifest value (tag included): what ``size_of`` needs to read."""
MAX_PARTS = 1 << 16
"""The most parts one object has: ``put`` refuses more (raise ``part_size``), and a manifest
naming more is corrupt, so that no manifest makes a reader or a cleanup handle more keys."""
T = TypeVar("T")
_MAP_FROM = 1 << 20  # fresh buffers of this size on are mappings (``_untouched``)
# Reads of a main key whose manifest's parts went missing: each time a newer object had been
# committed meanwhile (writers in a loop could supersede a slow reader's every read).
SUPERSEDED_READS = 4


class _PartMissing(Exception):
    """A part the manifest names is missing (``StripedObjects._object_of``)."""


class PartBackend(Protocol):
    """The primitive operations of a key-value server that ``StripedObjects`` builds on.

    Keys are bytes the connector has already namespaced; ``ttl`` is seconds or None (no expiry).
    Every method raises a ``GatewayError`` kind on failure, never returns None for one.
    """

    async def read(self, key: bytes) -> Buffer | None:
        """The value under ``key``, or None."""
        ...

    async def read_parts_into(self, keys: Sequence[bytes], dsts: Sequence[memoryview]) -> bool:
        """Fill ``dsts[i]`` with the value of ``keys[i]``; False if any is missing or has
        another length than its destination (then the destinations hold garbage).

        Both sequences make their items when indexed (a manifest may name many parts): take
        them one at a time, with a bounded number of reads in flight (``bounded_all``), and
        stop at the first part that is missing.
        """
        ...

    async def write_parts(self, items: Sequence[tuple[bytes, memoryview]], ttl: float) -> None:
        """Write every (key, value), each expiring after ``ttl`` seconds."""
        ...

    async def swap(
        self, key: bytes, value: Sequence[memoryview], ttl: float | None
    ) -> Buffer | None:
        """Set ``key`` to the concatenation of ``value`` and return the value it replaced."""
        ...

    async def take(self, key: bytes) -> Buffer | None:
        """Delete ``key`` and return the value it held (None if absent)."""
        ...

    async def set_ttl(self, keys: Sequence[bytes], ttl: float | None) -> None:
        """Give every existing key in ``keys`` this TTL (None: never expire)."""
        ...

    async def remove(self, keys: Sequence[bytes]) -> None:
        """Delete every key in ``keys`` (absent ones are fine)."""
        ...


@dataclass(frozen=True, slots=True)
class Manifest:
    gen: bytes
    total: int
    part_size: int
    count: int

    def encode(self) -> bytes:
        body = _MANIFEST.pack(_MAGIC, _VERSION, self.gen, self.total, self.part_size, self.count)
        return bytes([MANIFEST]) + body

    def spans(self) -> list[tuple[int, int]]:
        """(offset, length) of each part."""
        return [self.span(i) for i in range(self.count)]

    def span(self, i: int) -> tuple[int, int]:
        """(offset, length) of part ``i``."""
        offset = i * self.part_size
        return offset, min(self.part_size, self.total - offset)


class _Lazy(Sequence[T]):
    """A sequence whose items are made when asked for: a manifest of many parts costs no
    memory or time before its parts are actually read."""

    __slots__ = ("_count", "_item")

    def __init__(self, count: int, item: Callable[[int], T]) -> None:
        self._count = count
        self._item = item

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> T: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[T]: ...
    def __getitem__(self, index: int | slice) -> T | Sequence[T]:
        if isinstance(index, slice):
            return [self._item(i) for i in range(*index.indices(self._count))]
        if index < 0:
            index += self._count
        if not 0 <= index < self._count:
            raise IndexError(index)
        return self._item(index)


class MalformedValue(CorruptObject):
    """A main key holds something that is neither an inline value nor a manifest."""


class ValueOverReadLimit(MalformedValue, OverReadLimit):
    """A main key's object is larger than the reader takes: left in place (``OverReadLimit``)."""


class ForeignValue(MalformedValue, ForeignObject):
    """A main key holds a value kvgate did not write: left in place (``ForeignObject``)."""


def parse_head(value: Buffer) -> Manifest | None:
    """The manifest in ``value``, or None when ``value`` is an inline object.

    Raises ``ForeignValue`` for a value kvgate did not write (no tag, an unknown tag, no
    manifest magic: left in place by readers) and ``MalformedValue`` for a manifest of ours
    that is inconsistent.
    """
    view = memoryview(value).cast("B")
    if view.nbytes == 0:
        raise ForeignValue("empty value (no tag byte)")
    if view[0] == INLINE:
        return None
    if view[0] != MANIFEST:
        raise ForeignValue(f"unknown tag {view[0]}")
    if view.nbytes != MANIFEST_SIZE:
        raise MalformedValue(f"manifest of {view.nbytes} bytes")
    magic, version, gen, total, part_size, count = _MANIFEST.unpack(view[1:])
    if magic != _MAGIC:
        raise ForeignValue("no manifest magic")
    if version != _VERSION or part_size <= 0:
        raise MalformedValue("bad manifest version or part size")
    if count != -(-total // part_size):
        raise MalformedValue(f"manifest says {count} parts for {total} bytes of {part_size}")
    if count > MAX_PARTS:
        raise MalformedValue(f"manifest names {count} parts, over the {MAX_PARTS} ever written")
    return Manifest(gen, total, part_size, count)


def size_of(value: Buffer) -> int:
    """The object size a stored main-key value stands for (for ``list``)."""
    manifest = parse_head(value)
    return memoryview(value).nbytes - 1 if manifest is None else manifest.total


def slice_parts(data: BufferParts, part_size: int) -> list[memoryview]:
    """``data`` cut into consecutive ``part_size`` views; copies only where a part straddles
    two buffers of the scatter list."""
    out: list[memoryview] = []
    pending: list[memoryview] = []
    pending_len = 0
    for buf in as_parts(data):
        pos = 0
        while pos < buf.nbytes:
            take = min(part_size - pending_len, buf.nbytes - pos)
            piece = buf[pos : pos + take]
            pos += take
            if not pending and take == part_size:
                out.append(piece)
                continue
            pending.append(piece)
            pending_len += take
            if pending_len == part_size:
                out.append(memoryview(b"".join(pending)))
                pending, pending_len = [], 0
    if pending:
        out.append(pending[0] if len(pending) == 1 else memoryview(b"".join(pending)))
    return out


def _untouched(nbytes: int) -> memoryview:
    """A new buffer whose memory is taken as the parts arrive: a large one is a mapping of
    untouched pages (a bytearray is zeroed, all of it, on the event loop), so a manifest
    whose parts are missing costs address space, not memory or time."""
    if nbytes < _MAP_FROM:
        return memoryview(bytearray(nbytes))
    return memoryview(anonymous_memory(nbytes, populate=False, huge_pages=False))[:nbytes]


async def bounded_all(count: int, limit: int, call: Callable[[int], Awaitable[bool]]) -> bool:
    """Whether ``call(i)`` is True for every ``i`` in ``range(count)``.

    At most ``limit`` calls are in flight, made by as many workers that each take the next
    index: one task per worker, never one per call, so a large count costs nothing up front.
    The first False stops new calls (those in flight finish). The first exception cancels
    those in flight and waits for them before it propagates: no call outlives this one (they
    write into, or read from, the caller's buffers).
    """
    if min(count, limit) <= 1:
        return await _serial(count, call)
    indices = iter(range(count))
    ok = True

    async def worker() -> None:
        nonlocal ok
        for i in indices:  # shared: each index goes to one worker
            if not ok:
                return
            if not await call(i):
                ok = False

    workers = [asyncio.ensure_future(worker()) for _ in range(min(limit, count))]
    try:
        await asyncio.gather(*workers)
    except BaseException:
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        raise
    return ok


async def _serial(count: int, call: Callable[[int], Awaitable[bool]]) -> bool:
    for i in range(count):
        if not await call(i):
            return False
    return True


class StripedObjects:
    """put/get/delete of whole objects on a ``PartBackend``, atomically (see module docs).

    ``min_part_size``: the smallest ``part_size`` the connector's options allow; a manifest
    with smaller parts was not written by any configuration of it (a forged one, which would
    otherwise name many tiny parts).
    """

    def __init__(
        self,
        backend: PartBackend,
        *,
        parts_prefix: bytes,
        part_size: int,
        inline_max: int,
        pending_ttl: float = 3600.0,
        min_part_size: int = 1,
    ) -> None:
        if part_size <= 0 or inline_max < 0:
            raise ValueError("part_size must be positive and inline_max not negative")
        if not 0 < min_part_size <= part_size:
            raise ValueError(f"min_part_size must be in 1..part_size, got {min_part_size}")
        self.backend = backend
        self.parts_prefix = parts_prefix
        self.part_size = part_size
        self.inline_max = inline_max
        self.pending_ttl = pending_ttl
        self.min_part_size = min_part_size
        self._orphans: deque[bytes] = deque()  # part keys to remove again (see the module doc)

    def part_keys(self, manifest: Manifest) -> Sequence[bytes]:
        base = self.parts_prefix + manifest.gen.hex().encode() + b":"
        return _Lazy(manifest.count, lambda i: base + str(i).encode())

    async def put(self, key: bytes, data: BufferParts, ttl: float | None = None) -> None:
        parts = as_parts(data)
        total = sum(p.nbytes for p in parts)
        if total <= self.inline_max:
            previous = await self.backend.swap(key, [memoryview(bytes([INLINE])), *parts], ttl)
            await self._drop_superseded(previous)
            return
        manifest = Manifest(os.urandom(16), total, self.part_size, -(-total // self.part_size))
        if manifest.count > MAX_PARTS:
            raise CapacityError(
                f"an object of {total} bytes needs {manifest.count} parts of {self.part_size} "
                f"bytes, over {MAX_PARTS}: raise part_size"
            )
        keys = self.part_keys(manifest)
        slices = slice_parts(parts, self.part_size)
        pending = self.pending_ttl + (ttl or 0.0)
        try:
            await self.backend.write_parts(list(zip(keys, slices, strict=True)), pending)
        except Exception:
            # Nothing points at these parts; remove them now rather than wait for their TTL,
            # and once more later: one cut short by the failure may still land after this.
            await self._remove_quietly(keys, again=True)
            raise
        previous = await self.backend.swap(key, [memoryview(manifest.encode())], ttl)
        try:
            await self.backend.set_ttl(keys, None if ttl is None else pending)
        finally:  # the superseded parts no longer expire: remove them whatever happens here
            await self._drop_superseded(previous)

    async def get_into(self, key: bytes, alloc: Allocator) -> memoryview | None:
        """The object under ``key`` in a buffer from ``alloc`` (or a new one); None = miss."""
        head = await self.backend.read(key)
        if head is None:
            return None
        return await self.get_from_head(head, alloc, key)

    async def get_from_head(
        self, head: Buffer, alloc: Allocator, key: bytes | None = None
    ) -> memoryview | None:
        """The rest of ``get_into`` once the main key's value ``head`` has been read (for
        connectors that read it their own way).

        A part missing may mean that an overwrite committed after ``head`` was read and
        deleted the parts it names: the key always held an object, so ``key``'s value is read
        again, and a newer head is read instead (up to ``SUPERSEDED_READS`` times). The same
        head again means its parts were evicted or expired: a miss."""
        for _ in range(SUPERSEDED_READS):
            try:
                return await self._object_of(head, alloc)
            except _PartMissing:
                pass
            if key is None:
                return None
            newer = await self.backend.read(key)
            if newer is None or bytes(newer) == bytes(head):
                return None
            head = newer
        return None

    async def _object_of(self, head: Buffer, alloc: Allocator) -> memoryview | None:
        """The object ``head`` describes, or None for none; ``_PartMissing`` when a part it
        names is missing."""
        manifest = parse_head(head)
        if manifest is None:
            src = memoryview(head).cast("B")[1:]
            limit = read_limit()
            if limit is not None and src.nbytes > limit:  # read already, never copied
                raise ValueOverReadLimit(f"inline value of {src.nbytes} bytes, over {limit}")
            dst = alloc(src.nbytes)
            if dst is None:
                return src
            dst[:] = src
            return dst
        self._check_readable(manifest)
        dst = alloc(manifest.total)
        if dst is None:
            dst = _untouched(manifest.total)
        whole = dst

        def view(i: int) -> memoryview:
            offset, length = manifest.span(i)
            return whole[offset : offset + length]

        views = _Lazy(manifest.count, view)
        if not await self.backend.read_parts_into(self.part_keys(manifest), views):
            raise _PartMissing  # a partial set: superseded meanwhile, or evicted or expired
        return dst

    def _check_readable(self, manifest: Manifest) -> None:
        """``MalformedValue`` unless the manifest could be one of ours and its object is one
        the reader accepts (module docs): checked before anything is allocated or read."""
        if manifest.part_size < self.min_part_size:
            raise MalformedValue(
                f"manifest parts of {manifest.part_size} bytes, under the smallest part size "
                f"({self.min_part_size})"
            )
        limit = read_limit()
        if limit is not None and manifest.total > limit:
            raise ValueOverReadLimit(f"manifest claims {manifest.total} bytes, over {limit}")

    async def get(self, key: bytes) -> Buffer | None:
        """Like ``get_into`` with fresh memory; an inline object is returned without a copy."""
        return await self.get_into(key, lambda n: None)

    async def delete(self, key: bytes) -> bool:
        previous = await self.backend.take(key)
        await self._drop_superseded(previous)
        return previous is not None

    async def _drop_superseded(self, previous: Buffer | None) -> None:
        manifest = None
        if previous is not None:
            # garbage under the key is not ours: nothing of ours to clean up
            with contextlib.suppress(MalformedValue):
                manifest = parse_head(previous)
        if manifest is not None:
            await self._remove_quietly(self.part_keys(manifest))
        elif self._orphans:  # a commit went through: the server takes requests again
            await self._remove_quietly(())

    async def _remove_quietly(self, keys: Sequence[bytes], *, again: bool = False) -> None:
        """Remove ``keys`` with up to ``ORPHANS_PER_REMOVAL`` kept ones; what this fails to
        remove is kept for the next try (``again``: ``keys`` are kept even when it works)."""
        count = min(len(self._orphans), ORPHANS_PER_REMOVAL)
        kept = [self._orphans.popleft() for _ in range(count)]
        batch = [*keys, *kept]
        if not batch:
            return
        try:
            await self.backend.remove(batch)
        except Exception as exc:
            self._keep(batch)
            _log.debug("could not remove %d parts (kept to try again): %s", len(batch), exc)
            return
        if again:
            self._keep(keys)

    def _keep(self, keys: Sequence[bytes]) -> None:
        self._orphans.extend(keys)
        over = len(self._orphans) - ORPHANS_KEPT
        if over > 0:
            for _ in range(over):
                self._orphans.popleft()
            _log.warning(
                "forgot %d part keys whose removal failed (over %d kept): those without a TTL "
                "stay on the server until deleted by hand",
                over,
                ORPHANS_KEPT,
            )
