"""Tiers: the in-process L1 (decoded objects in the buffer pool) and connector-backed tiers.

A ``ConnectorTier`` is a connector wrapped in its layer stack plus a codec: it turns objects
into frames on write and verified frames back into objects on read. Corrupt or expired frames
are misses (counted, and deleted from the backend; an encrypted one this tier holds no key
for is counted but left for a reader that has it); backend failures propagate to the store,
which counts them and treats them as misses.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from gateway.codec import Codec, decode_payload, encode_payload, frame_head
from gateway.codec_chain import ChainCodec, with_known_stages
from gateway.connector import (
    PLACEMENT,
    Connector,
    address_of,
    as_parts,
    discarding,
    limiting_reads,
    writing_position,
)
from gateway.errors import (
    CapacityError,
    ConfigError,
    CorruptObject,
    CorruptRemoved,
    ForeignObject,
    GatewayError,
    InvalidObject,
    KeyUnavailable,
    MissingDependency,
    OverReadLimit,
    Unsupported,
)
from gateway.frame import MAX_HEADER_LEN, FrameHeader, decode_frame, payload_offset_of
from gateway.frame_check import StreamingChecksum
from gateway.log_limit import RepeatLimiter
from gateway.memory import BufferPool, Slab
from gateway.object_meta import meta_of_frame
from gateway.objects import COPIED_KINDS, ObjectData, ObjectMeta, to_object
from gateway.policies import EvictionPolicy
from gateway.registry import load_codec
from gateway.side_objects import REFRESH_WRITES, MissingSideObject, SideObjectUnavailable
from gateway.thread_jobs import in_thread
from gateway.types import Buffer, TierStats
from gateway.unreadable import UnreadableKeys

log = logging.getLogger("kvgate.tiers")

# Objects a read refuses but does not delete: bytes the backend already took away, and
# objects that may be someone else's to read (too large for this reader, not kvgate's, or
# encrypted under a key this process lacks), in a backend other stores or programs share.
_LEFT_IN_PLACE = (CorruptRemoved, ForeignObject, KeyUnavailable, OverReadLimit)

OFFLOAD_BYTES = 4 << 20  # CPU work on larger buffers runs in a thread, off the event loop
T = TypeVar("T")


# CPU work (copies, checksums, codecs) has its own few threads: torch keeps an OpenMP team per
# calling thread, and measured here a 32 MiB copy runs at ~14 GB/s from a steady thread but
# ~11 GB/s when it hops among asyncio's default executor threads.
def _cpu_threads() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=os.cpu_count() or 2, thread_name_prefix="kvgate-cpu")


_CPU_THREADS = _cpu_threads()


def _new_threads_after_fork() -> None:
    # A forked child inherits the executor but not its threads: jobs would never run.
    global _CPU_THREADS
    _CPU_THREADS = _cpu_threads()


os.register_at_fork(after_in_child=_new_threads_after_fork)

MAX_CACHED_CODECS = 64


def codec_inline(codec: Codec) -> bool:
    """Whether ``codec``'s encode and decode of an object under ``OFFLOAD_BYTES`` may run on the
    event loop: the one rule every offload decision about codec work asks.

    Raw work is a copy at most. Any other codec runs inline only when its instance says so with
    ``inline_ok = True``, for its own settings (zstd at a low level, not at 22: see
    ``serde.zstd``). Codecs that do not say so (kernels compiled on first use, keys, chains,
    plugins) always run in a thread, whatever the object's size.
    """
    return codec.name == "raw" or getattr(codec, "inline_ok", False) is True


async def offload(
    nbytes: int,
    fn: Callable[..., T],
    *args: Any,
    device: bool = False,
) -> T:
    """Run ``fn`` inline for inputs under ``OFFLOAD_BYTES``, in a CPU worker thread for
    larger ones.

    ``device``: the work touches a GPU tensor (a copy to the host waits for its stream) or may
    take long whatever the size (a codec compiling its kernels), so it runs in a thread.

    If the caller is cancelled, this still waits for the thread to finish before re-raising:
    ``fn`` works on pool slabs that the caller releases as soon as this returns.
    """
    if nbytes < OFFLOAD_BYTES and not device:
        return fn(*args)
    return await in_thread(_CPU_THREADS, functools.partial(fn, *args))


class Found:
    """An object fetched from a tier: metadata and its bytes, in a pool slab when possible.

    A Found owns one reference to its slab, released when the Found is garbage collected;
    every object handed to a caller takes its own lease.
    """

    __slots__ = ("__weakref__", "buffer", "expires_at", "meta", "offset", "slab")

    def __init__(
        self,
        meta: ObjectMeta,
        *,
        slab: Slab | None = None,
        offset: int = 0,
        buffer: Buffer | None = None,
        expires_at: float | None = None,
    ) -> None:
        self.meta = meta
        self.slab = slab
        self.offset = offset
        self.buffer = buffer
        self.expires_at = expires_at  # wall-clock seconds, as in frame headers
        if slab is not None:
            weakref.finalize(self, slab.release)

    def copies(self) -> bool:
        """Whether ``to_object`` copies the bytes (else it is a zero-copy view: cheap)."""
        if self.meta.kind in COPIED_KINDS:
            return True
        # torch cannot wrap read-only memory: to_object copies it first
        return (
            self.meta.kind == "tensor"
            and self.slab is None
            and self.buffer is not None
            and memoryview(self.buffer).readonly
        )

    def stored_bytes(self) -> memoryview:
        """The object's bytes as stored: a lease on the slab, or the buffer (never a copy)."""
        if self.slab is None:
            assert self.buffer is not None
            return memoryview(self.buffer).cast("B")
        return self.slab.lease(self.offset, self.meta.nbytes)

    def to_object(self) -> object:
        if self.slab is None:
            assert self.buffer is not None
            return to_object(self.meta, self.buffer)
        if self.meta.kind in COPIED_KINDS:  # copied out: no lease needed
            return to_object(self.meta, self.slab.view(self.offset, self.meta.nbytes))
        return to_object(self.meta, self.slab.lease(self.offset, self.meta.nbytes))


@dataclass(slots=True)
class L1Entry:
    meta: ObjectMeta
    slab: Slab  # the index's reference
    offset: int
    expires_at: float | None = None  # wall-clock seconds, as in frame headers

    def expired(self) -> bool:
        return self.expires_at is not None and time.time() > self.expires_at

    def lease(self) -> memoryview:
        """The object's bytes, a lease on the slab (held while the view lives)."""
        return self.slab.lease(self.offset, self.meta.nbytes)


class MemoryTier:
    """L1: decoded objects in the buffer pool, indexed by key, evicted by policy."""

    def __init__(self, name: str, pool: BufferPool, policy: EvictionPolicy[str]) -> None:
        self.name = name
        self.pool = pool
        self.policy = policy
        self.index: dict[str, L1Entry] = {}
        self.stats = TierStats(name)

    def lookup(self, key: str) -> L1Entry | None:
        entry = self.index.get(key)
        if entry is not None and entry.expired():
            self.remove(key)
            entry = None
        if entry is None:
            self.stats.misses += 1
            return None
        self.policy.touch(key)
        self.stats.hits += 1
        self.stats.bytes_read += entry.meta.nbytes
        return entry

    def __contains__(self, key: str) -> bool:
        entry = self.index.get(key)
        return entry is not None and not entry.expired()

    def holds(self, key: str, slab: Slab) -> bool:
        """Whether ``slab`` is what the index keeps under ``key`` (one of its references)."""
        entry = self.index.get(key)
        return entry is not None and entry.slab is slab

    def insert(
        self,
        key: str,
        meta: ObjectMeta,
        slab: Slab,
        offset: int = 0,
        expires_at: float | None = None,
    ) -> None:
        """Index ``slab`` under ``key``; takes over one reference of the caller's."""
        self.remove(key)
        self.index[key] = L1Entry(meta, slab, offset, expires_at)
        self.pool.set_cached(slab, True)
        self.policy.insert(key, slab.size)
        self.stats.puts += 1
        self.stats.bytes_written += meta.nbytes

    def remove(self, key: str) -> bool:
        entry = self.index.pop(key, None)
        if entry is None:
            return False
        self.policy.remove(key)
        self.pool.set_cached(entry.slab, False)
        entry.slab.release()
        return True

    def _evictable(self, key: str) -> bool:
        # Only the index holds it: evicting frees memory now. Leased or queued slabs are
        # skipped because evicting them would free nothing until their holders finish.
        return self.index[key].slab.refs == 1

    def alloc(self, nbytes: int) -> Slab | None:
        """A slab for ``nbytes``, evicting unreferenced entries by policy to make room.

        Nothing is evicted for a request that eviction cannot satisfy: one larger than the
        pool, or than its free bytes plus the entries nothing else holds (readers and queued
        writes hold the rest, and evicting frees none of it). Such a request (a large object
        read from a lower tier) is None at once, and the cache keeps its objects.
        """
        slab = self.pool.alloc(nbytes)
        if slab is not None or nbytes > self.pool.room_after_eviction():
            return slab
        while slab is None:
            victim = self.policy.victim(self._evictable)
            if victim is None:
                return None
            entry = self.index.pop(victim)
            self.pool.set_cached(entry.slab, False)
            entry.slab.release()
            self.stats.evictions += 1
            slab = self.pool.alloc(nbytes)
        return slab


class ConnectorTier:
    """A connector (already wrapped in its layers) with a codec and a TTL."""

    def __init__(
        self,
        name: str,
        connector: Connector,
        codec: Codec,
        stats: TierStats,
        *,
        ttl: float | None = None,
    ) -> None:
        self.name = name
        self.connector = connector
        self.codec = codec
        self.stats = stats
        self.ttl = ttl
        # Objects left in place stay, and every read of one misses again: one line per kind
        # and interval, with the count of those not logged.
        self._left_in_place = RepeatLimiter()
        # ... and lookups of their keys answer "not here", so the engine stores its own object.
        self.unreadable = UnreadableKeys()
        self._codecs: dict[str, Codec] = {codec.name: codec}
        # Side objects this tier wrote, and how many frames it has written since each.
        self._side_written: dict[str, int] = {}
        # The configured instances by name, a chain's stages too: a frame written by another
        # chain (or by one of these codecs alone) decodes with them, so an aesgcm stage uses
        # this tier's keys. Other codecs are built with their defaults.
        self._configured: dict[str, Codec] = {codec.name: codec}
        if isinstance(codec, ChainCodec):
            self._configured.update((s.name, s) for s in codec.stages)
        # What the codec (or a chain's stages) needs in this tier before its frames: fixed
        # when the codec is built, so found once here rather than on every put.
        self._side_objects: list[tuple[str, bytes]] = [
            item
            for c in [codec, *(codec.stages if isinstance(codec, ChainCodec) else [])]
            for item in getattr(c, "side_objects", [])
        ]

    def _codec_for(self, header: FrameHeader) -> Codec:
        # A store reads every object whatever codec wrote it: the frame names the codec.
        codec = self._codecs.get(header.codec)
        if codec is None:
            try:
                codec = with_known_stages(header.codec, self._configured, load_codec)
            except ConfigError as exc:
                # Defaults fail only for a codec that needs keys this tier was not given
                # (aesgcm): nothing here can read the frame, a reader with keys can.
                raise KeyUnavailable(f"cannot build codec {header.codec!r} here: {exc}") from None
            if len(self._codecs) < MAX_CACHED_CODECS:  # frame names are backend data: bounded
                self._codecs[header.codec] = codec
        return codec

    async def write(self, key: str, obj: ObjectData, ttl: float | None = None) -> None:
        meta = obj.meta
        limit = self.connector.capabilities.max_object_size
        checksum = None
        if self.codec.name == "raw":  # host() copies only GPU or strided objects
            if obj.host_ready:
                payload: Any = obj.host()
            else:
                payload = await offload(meta.nbytes, obj.host, device=not obj.on_host)
            params: dict[str, Any] = {}
            checksum = obj.checksum  # the payload is the object's bytes
        else:
            slow = not codec_inline(self.codec) or not obj.on_host
            payload, params = await offload(
                meta.nbytes, encode_payload, self.codec, obj, key, device=slow
            )
        parts = as_parts(payload)
        size = sum(p.nbytes for p in parts)
        if limit is not None and size > limit:
            raise CapacityError(f"{size} bytes exceed {self.name}'s object limit of {limit}")
        if self._side_objects:
            await self._write_side_objects()
        head, _ = await offload(
            0 if checksum is not None else size,  # known checksum: nothing left to hash
            frame_head,
            self.codec.name,
            meta,
            parts,
            params,
            self.ttl if ttl is None else ttl,
            checksum,
            key,
        )
        with writing_position(obj.position):  # for a gateway:// tier's remote codecs
            await self.connector.put(key, [head, *parts])
        self.unreadable.written(key)

    async def _write_side_objects(self) -> None:
        """Put the codec's side objects before the first frame that needs them (and again
        every ``REFRESH_WRITES`` frames: a capacity-bound backend may have evicted them)."""
        for key, data in self._side_objects:
            since = self._side_written.get(key)
            if since is not None and since < REFRESH_WRITES:
                self._side_written[key] = since + 1
                continue
            meta = ObjectMeta("bytes", "uint8", (len(data),), len(data))
            head, _ = await offload(len(data), frame_head, "raw", meta, [memoryview(data)], {})
            await self.connector.put(key, [head, memoryview(data)])
            self._side_written[key] = 0

    async def read(
        self, key: str, alloc: Callable[[int], Slab | None], max_size: int
    ) -> Found | None:
        """The verified, decoded object, or None (miss, corrupt or expired: counted).

        ``max_size`` bounds what a header may claim, so a hostile or corrupted frame cannot
        make a codec allocate more than any object the store accepts; the connector sees the
        bound as ``read_limit()`` (a frame of such an object) for what it reads first.
        """
        # Whether the object is left in place for others (True), readable or gone (False), or
        # nothing was learnt (None): the lookups' marks (``UnreadableKeys``) follow it.
        unreadable: bool | None = None
        self.unreadable.begin_read(key)
        try:
            with limiting_reads(frame_limit(max_size)):
                found = await self._read(key, alloc, max_size)
            unreadable = False  # readable again (another writer replaced it), or gone
            return found
        except SideObjectUnavailable as exc:  # the frame is sound: kept for who has it
            self.stats.corrupt += 1
            unreadable = True
            log.warning("tier %s: object under a key served as a miss: %s", self.name, exc)
            return None
        except CorruptObject as exc:
            self.stats.corrupt += 1
            if isinstance(exc, _LEFT_IN_PLACE):
                unreadable = True
                quiet = self._left_in_place.admit(type(exc).__name__)
                if quiet is not None:
                    more = f" ({quiet} more such misses since the last line)" if quiet else ""
                    log.warning(
                        "tier %s: an object under a key served as a miss and left in place: %s%s",
                        self.name,
                        exc,
                        more,
                    )
                return None
            log.warning("tier %s: corrupt object under a key, served as a miss: %s", self.name, exc)
            await self._discard(key)
            unreadable = False
            return None
        finally:
            self.unreadable.end_read(key, unreadable)

    async def _read(
        self, key: str, alloc: Callable[[int], Slab | None], max_size: int
    ) -> Found | None:
        alloc_frame = _FrameAlloc(alloc)
        try:
            if self.connector.capabilities.zero_copy:
                blob: Buffer | None = await self.connector.get_into(key, alloc_frame)
            else:
                blob = await self.connector.get(key)
            if blob is None:
                return None
            size = memoryview(blob).nbytes
            digest = alloc_frame.digest(blob)
            if digest is not None:  # hashed while it was read: the rest is a header check
                header, payload = decode_frame(blob, digest=digest, key=key)
            else:
                header, payload = await offload(
                    size, functools.partial(decode_frame, key=key), blob
                )
            if header.raw_len > max_size:
                raise OverReadLimit(f"frame claims {header.raw_len} bytes, over {max_size}")
            meta = _meta_of(header)
            if header.expired():
                await self._discard(key)
                return None
            in_slab = alloc_frame.slab_of(blob) if header.codec == "raw" else None
            if in_slab is not None:
                if payload.nbytes != header.raw_len:
                    in_slab.release()
                    raise CorruptObject("raw payload length differs from the object's length")
                # The frame is in a pool slab: the payload is used in place, no copy.
                offset = alloc_frame.shift + size - payload.nbytes
                return Found(meta, slab=in_slab, offset=offset, expires_at=_expiry(header))
            codec = self._codec_for(header)
            out_slab = alloc(header.raw_len)
            out = out_slab.view() if out_slab is not None else None
            try:
                slow = not codec_inline(codec)
                decode = functools.partial(decode_payload, codec, payload, header, out, key)
                try:
                    raw = await offload(header.raw_len, decode, device=slow)
                except MissingSideObject as missing:  # fetched from this tier, then again
                    await self._install_side_object(missing, max_size)
                    raw = await offload(header.raw_len, decode, device=slow)
            except BaseException:
                if out_slab is not None:
                    out_slab.release()
                raise
            if out_slab is not None and out is not None and _same_memory(raw, out):
                return Found(meta, slab=out_slab, offset=0, expires_at=_expiry(header))
            if out_slab is not None:
                out_slab.release()
            if memoryview(raw).nbytes != header.raw_len:
                raise CorruptObject(f"codec {header.codec} returned the wrong length")
            return Found(meta, buffer=raw, expires_at=_expiry(header))
        finally:
            for slab in alloc_frame.slabs:
                slab.release()

    async def _install_side_object(self, missing: MissingSideObject, max_size: int) -> None:
        """Read the side object a frame names from this tier and hand it to the codec;
        ``SideObjectUnavailable`` when it is not there or its bytes are not the named ones."""
        try:
            found = await self._read(missing.key, lambda _n: None, max_size)
        except CorruptObject as exc:
            raise SideObjectUnavailable(f"{missing}; {missing.key} is corrupt: {exc}") from None
        if found is None or found.meta.kind != "bytes":
            raise SideObjectUnavailable(f"{missing}; {missing.key} is not in this tier")
        data = found.to_object()
        assert isinstance(data, bytes)
        try:
            await offload(len(data), missing.install, data, device=True)
        except CorruptObject as exc:
            raise SideObjectUnavailable(f"{missing.key}: {exc}") from None

    async def _discard(self, key: str) -> None:
        try:
            with discarding():  # no wait for other readers: they verify what they read
                await self.connector.delete(key)
        except (GatewayError, OSError) as exc:
            log.debug("tier %s: could not delete a bad object: %s", self.name, exc)

    async def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """Whether the tier holds each key; objects this store left in place as unreadable
        count as absent (``UnreadableKeys``)."""
        flags = await self.connector.exists_many(keys)
        return self.unreadable.hide(keys, flags)

    async def delete(self, key: str) -> bool:
        removed = await self.connector.delete(key)
        self.unreadable.written(key)
        return removed


class _FrameAlloc:
    """The allocator a tier hands its connector: pool slabs, plus the ``filled`` hook that
    checksums the frame while the connector reads it (see ``gateway.connector.Allocator``).

    A connector may call it more than once (a retry, a file replaced while it was read) and
    may end up returning a buffer of its own: only the buffer given last, and only if it is
    the one returned, is trusted to hold the frame (``slab_of``) or its digest (``digest``).
    """

    __slots__ = ("_alloc", "_check", "_given", "shift", "slabs")

    def __init__(self, alloc: Callable[[int], Slab | None]) -> None:
        self._alloc = alloc
        self.slabs: list[Slab] = []  # every slab given, released by the caller
        self._given: tuple[Slab, memoryview] | None = None  # the latest, if it was a slab
        self._check: StreamingChecksum | None = None
        self.shift = 0  # where in its slab the latest buffer starts

    def __call__(self, n: int) -> memoryview | None:
        return self._give(n, None)

    def placed(self, n: int, phase: int) -> memoryview | None:
        """A buffer whose address is ``phase`` modulo PLACEMENT (see ``PlacedAllocator``): a
        slab one page larger, used from the right offset."""
        return self._give(n, phase % PLACEMENT)

    def _give(self, n: int, phase: int | None) -> memoryview | None:
        self._given = None
        self._check = None
        self.shift = 0
        slab = self._alloc(n if phase is None else n + PLACEMENT)
        if slab is None:
            return None
        self.slabs.append(slab)
        if phase is not None and n:
            self.shift = (phase - address_of(slab.view())) % PLACEMENT
        view = slab.view(self.shift, n)
        self._given = (slab, view)
        self._check = StreamingChecksum(view)
        return view

    def filled(self, start: int, stop: int) -> None:
        check = self._check
        if check is not None:
            check.filled(start, stop)

    def _holds(self, blob: Buffer) -> bool:
        return self._given is not None and _same_memory(blob, self._given[1])

    def slab_of(self, blob: Buffer) -> Slab | None:
        """The slab ``blob`` lies in, taken out of ``slabs`` (the caller now owns it)."""
        if self._given is None or not self._holds(blob):
            return None
        slab = self._given[0]
        self.slabs.remove(slab)
        return slab

    def digest(self, blob: Buffer) -> int | None:
        """The payload digest, if ``blob`` is the buffer given last and it was all reported."""
        if self._check is None or not self._holds(blob):
            return None
        return self._check.digest()


def frame_limit(max_size: int) -> int:
    """The largest frame of an object of at most ``max_size`` bytes: the largest header, and
    the payload, which a codec may make a little larger than the object (zstd and lz4 add
    well under 1/64 to incompressible data). What a connector may be asked to read for it."""
    return payload_offset_of(MAX_HEADER_LEN) + max_size + max_size // 64


def _expiry(header: FrameHeader) -> float | None:
    return None if header.ttl is None else header.created_at + header.ttl


def _same_memory(a: Buffer, b: memoryview) -> bool:
    """Whether ``a`` is exactly the memory of ``b``: same address and length. (Views of one
    arena share their ``obj``, so comparing that would confuse two slabs of equal size.)"""
    if a is b:
        return True
    view = memoryview(a)
    if view.nbytes != b.nbytes or view.nbytes == 0:
        return False
    return address_of(view) == address_of(b)


def _meta_of(header: FrameHeader) -> ObjectMeta:
    # What no put can have written is corrupt. A dtype that only this process lacks (bfloat16
    # ndarrays without ml_dtypes) propagates instead: the object stays for one that has it.
    try:
        return meta_of_frame(header)
    except MissingDependency:
        raise
    except (InvalidObject, Unsupported) as exc:
        raise CorruptObject(f"frame header does not describe its object: {exc}") from None
