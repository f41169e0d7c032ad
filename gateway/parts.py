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
- every part must come back with exactly its expected length, else the whole read is a miss
  (a part evicted by the server, expired, or deleted by a later overwrite).

Parts are written with a "pending" TTL, so that the parts of a write that dies before its commit
expire by themselves. After the commit they are made durable (no TTL, or the object's TTL plus
the pending margin). A crash between the commit and that step leaves an object whose parts
later expire: it becomes a miss, never wrong. The commit swaps ``K`` and returns the value it
replaced; when that was a manifest, the superseded parts are deleted (each old manifest is
returned by exactly one swap, so concurrent writers clean up after each other exactly once).
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.connector import Allocator, as_parts
from gateway.errors import CorruptObject
from gateway.types import Buffer, BufferParts

INLINE = 0
MANIFEST = 1
_MANIFEST = struct.Struct("<4sB16sQQI")
_log = logging.getLogger(__name__)
_MAGIC = b"KVGP"
_VERSION = 1
MANIFEST_SIZE = 1 + _MANIFEST.size
"""Bytes of a stored manifest value (tag included): what ``size_of`` needs to read."""


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
        another length than its destination (then the destinations hold garbage)."""
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
        return [
            (i * self.part_size, min(self.part_size, self.total - i * self.part_size))
            for i in range(self.count)
        ]


class MalformedValue(CorruptObject):
    """A main key holds something that is neither an inline value nor a manifest."""


def parse_head(value: Buffer) -> Manifest | None:
    """The manifest in ``value``, or None when ``value`` is an inline object.

    Raises ``MalformedValue`` for anything else (not written by ``StripedObjects``).
    """
    view = memoryview(value).cast("B")
    if view.nbytes == 0:
        raise MalformedValue("empty value (no tag byte)")
    if view[0] == INLINE:
        return None
    if view[0] != MANIFEST or view.nbytes != MANIFEST_SIZE:
        raise MalformedValue(f"unknown tag {view[0]} or manifest of {view.nbytes} bytes")
    magic, version, gen, total, part_size, count = _MANIFEST.unpack(view[1:])
    if magic != _MAGIC or version != _VERSION or part_size <= 0:
        raise MalformedValue("bad manifest magic, version or part size")
    if count != -(-total // part_size):
        raise MalformedValue(f"manifest says {count} parts for {total} bytes of {part_size}")
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


class StripedObjects:
    """put/get/delete of whole objects on a ``PartBackend``, atomically (see module docs)."""

    def __init__(
        self,
        backend: PartBackend,
        *,
        parts_prefix: bytes,
        part_size: int,
        inline_max: int,
        pending_ttl: float = 3600.0,
    ) -> None:
        if part_size <= 0 or inline_max < 0:
            raise ValueError("part_size must be positive and inline_max not negative")
        self.backend = backend
        self.parts_prefix = parts_prefix
        self.part_size = part_size
        self.inline_max = inline_max
        self.pending_ttl = pending_ttl

    def part_keys(self, manifest: Manifest) -> list[bytes]:
        base = self.parts_prefix + manifest.gen.hex().encode() + b":"
        return [base + str(i).encode() for i in range(manifest.count)]

    async def put(self, key: bytes, data: BufferParts, ttl: float | None = None) -> None:
        parts = as_parts(data)
        total = sum(p.nbytes for p in parts)
        if total <= self.inline_max:
            previous = await self.backend.swap(key, [memoryview(bytes([INLINE])), *parts], ttl)
            await self._drop_superseded(previous)
            return
        manifest = Manifest(os.urandom(16), total, self.part_size, -(-total // self.part_size))
        keys = self.part_keys(manifest)
        slices = slice_parts(parts, self.part_size)
        pending = self.pending_ttl + (ttl or 0.0)
        try:
            await self.backend.write_parts(list(zip(keys, slices, strict=True)), pending)
        except Exception:
            # Nothing points at these parts; remove them now rather than wait for their TTL.
            await self._remove_quietly(keys)
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
        return await self.get_from_head(head, alloc)

    async def get_from_head(self, head: Buffer, alloc: Allocator) -> memoryview | None:
        """The rest of ``get_into`` once the main key's value ``head`` has been read (for
        connectors that read it their own way)."""
        manifest = parse_head(head)
        if manifest is None:
            src = memoryview(head).cast("B")[1:]
            dst = alloc(src.nbytes)
            if dst is None:
                return src
            dst[:] = src
            return dst
        dst = alloc(manifest.total)
        if dst is None:
            dst = memoryview(bytearray(manifest.total))
        views = [dst[off : off + n] for off, n in manifest.spans()]
        if not await self.backend.read_parts_into(self.part_keys(manifest), views):
            return None  # a partial set: evicted, expired or superseded meanwhile
        return dst

    async def get(self, key: bytes) -> Buffer | None:
        """Like ``get_into`` with fresh memory; an inline object is returned without a copy."""
        return await self.get_into(key, lambda n: None)

    async def delete(self, key: bytes) -> bool:
        previous = await self.backend.take(key)
        await self._drop_superseded(previous)
        return previous is not None

    async def _drop_superseded(self, previous: Buffer | None) -> None:
        if previous is None:
            return
        try:
            manifest = parse_head(previous)
        except MalformedValue:
            return  # not ours (garbage under the key): nothing of ours to clean up
        if manifest is not None:
            await self._remove_quietly(self.part_keys(manifest))

    async def _remove_quietly(self, keys: Sequence[bytes]) -> None:
        """Best effort: parts nobody points at also expire by their pending TTL."""
        try:
            await self.backend.remove(keys)
        except Exception as exc:
            _log.debug(
                "could not remove %d orphaned parts (they expire by TTL): %s", len(keys), exc
            )
