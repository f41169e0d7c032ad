"""The Connector contract: transport only, bytes in and bytes out.

Behaviour every connector must have (``gateway.testing`` checks it on a real backend):

- ``get(key)`` returns the whole object last written under ``key``, or ``None`` on a miss.
  Failures raise a ``GatewayError`` (``Unavailable``, ``Timeout``, ...); they are never ``None``.
- ``put(key, data)`` is atomic: a concurrent or later reader sees either the old object or the
  new one whole, never a mix or a prefix. ``data`` may be one buffer or a scatter list whose
  concatenation is the object; the connector must not keep references to it after returning.
- ``exists`` / ``delete`` report whether the key was present.
- ``close()`` releases clients and threads; calling it twice is harmless.
- Blocking client libraries run in a thread inside the connector, through
  ``gateway.thread_jobs.in_thread`` when the thread reads the caller's buffers: a cancelled
  caller must still wait for it (``asyncio.to_thread`` does not), since it may reuse them.

Keys are arbitrary non-empty strings (LMCache key strings, ``str`` keys of users); a connector
maps them to whatever its backend allows, without collisions and without path traversal.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextvars import ContextVar, Token
from typing import ClassVar, Generic, Protocol, TypeVar, runtime_checkable

import numpy as np

from gateway.errors import Unsupported
from gateway.types import Buffer, BufferParts, Capabilities, ObjectInfo

T = TypeVar("T")
V = TypeVar("V")  # a context variable's value

Allocator = Callable[[int], memoryview | None]
"""Gives a writable buffer of exactly n bytes (a pool slab), or None when there is no room.

An allocator may also have a ``filled(start, stop)`` method. A connector that fills the buffer
in ranges may call it, from any thread, each time ``buf[start:stop]`` holds its final bytes;
the store then checksums those bytes while they are still in the CPU cache. Calling it is
optional (nothing is lost without it). Ranges refer to the buffer alloc gave last, are
reported once each and do not overlap; they are never reported for a buffer of the
connector's own. The hook hashes the bytes in the calling thread and takes a lock briefly: it
never blocks on I/O.
"""

FillHook = Callable[[int, int], None]

PlacedAllocator = Callable[[int, int], memoryview | None]
"""An allocator may also have a ``placed(n, phase)`` method: like ``alloc(n)``, but the buffer's
address is ``phase`` modulo PLACEMENT (a page). A connector that reads with O_DIRECT asks for
the phase of the file offset it reads from, so the disk can fill the buffer itself. The
``filled`` ranges then refer to that buffer."""

PLACEMENT = 4096  # a page: what O_DIRECT needs of addresses and offsets on any device


def address_of(view: memoryview) -> int:
    """The address of a buffer's first byte (read-only buffers included)."""
    return int(np.frombuffer(view.cast("B"), dtype=np.uint8).ctypes.data)


def fill_hook(alloc: Allocator) -> FillHook | None:
    """``alloc.filled`` if the allocator offers one (see ``Allocator``)."""
    hook = getattr(alloc, "filled", None)
    return hook if callable(hook) else None


def placement_hook(alloc: Allocator) -> PlacedAllocator | None:
    """``alloc.placed`` if the allocator offers one (see ``PlacedAllocator``)."""
    hook = getattr(alloc, "placed", None)
    return hook if callable(hook) else None


_READ_LIMIT: ContextVar[int | None] = ContextVar("kvgate_read_limit", default=None)


def read_limit() -> int | None:
    """The most bytes the current reader accepts as one stored value, or None when no limit
    is known (a connector used on its own, outside a Store).

    A connector that learns a value's size from something stored that nothing has verified
    yet (a manifest, a declared length) refuses a larger size as ``CorruptObject`` before it
    allocates anything: a forged size must never become an allocation. The Store's tiers set
    it from ``max_object_size`` around each read (``limiting_reads``). It is a context
    variable rather than an argument so that it reaches ``get`` and ``get_into`` of every
    connector, through every layer, without widening the Connector protocol.
    """
    return _READ_LIMIT.get()


def limiting_reads(nbytes: int) -> Holding[int | None]:
    """``read_limit()`` is ``nbytes`` inside this block (and in tasks started from it)."""
    return Holding(_READ_LIMIT, nbytes)


_DURABLE: ContextVar[bool] = ContextVar("kvgate_durable_write", default=False)


def durable_write() -> bool:
    """Whether the write under way must be durable end to end (a durable put).

    Most connectors are durable as soon as ``put`` returns, or as durable as their backend;
    one whose backend is itself a write-back cache (``gateway://``, another kvgate) asks it
    to write through when this is true. A context variable, like ``read_limit``, so that it
    reaches ``put`` through every layer without widening the Connector protocol.
    """
    return _DURABLE.get()


def writing_durably(durable: bool = True) -> Holding[bool]:
    """``durable_write()`` is ``durable`` inside this block (and in tasks started from it)."""
    return Holding(_DURABLE, durable)


_POSITION: ContextVar[int | None] = ContextVar("kvgate_write_position", default=None)


def write_position() -> int | None:
    """Where the object being written starts in its token sequence (``Store.put(position=)``),
    or None when the put did not say.

    The tier's codec has used it already; a connector whose backend encodes objects with codecs
    of its own (``gateway://``: another kvgate, whose ``kvtc`` undoes RoPE with it) passes it
    on. A context variable, like ``durable_write``, for the same reason.
    """
    return _POSITION.get()


def writing_position(position: int | None) -> Holding[int | None]:
    """``write_position()`` is ``position`` inside this block (and in tasks started from it)."""
    return Holding(_POSITION, position)


_DISCARDING: ContextVar[bool] = ContextVar("kvgate_discarding", default=False)


def discarding_unusable() -> bool:
    """Whether the delete under way removes bytes a reader just found unusable (corrupt or
    expired).

    A connector whose delete waits for other readers to finish (Mooncake refuses to remove
    an object a reader holds a lease on, and the read that found the bytes corrupt took one)
    may skip that wait: every reader verifies what it reads. A context variable, like
    ``durable_write``, for the same reason.
    """
    return _DISCARDING.get()


def discarding(value: bool = True) -> Holding[bool]:
    """``discarding_unusable()`` is ``value`` inside this block."""
    return Holding(_DISCARDING, value)


class Holding(Generic[V]):
    """A ``with`` block in which ``var`` is ``value``, its old value again after.

    A class rather than a ``contextlib.contextmanager`` generator: every put and get enters
    one or two of these, and a generator-based one cost several times as much (2-3 us of the
    ~35 us a put spends in kvgate's own code). A block that would set the value the variable
    already has leaves it alone.
    """

    __slots__ = ("_entered", "_token", "_value", "_var")

    def __init__(self, var: ContextVar[V], value: V) -> None:
        self._var = var
        self._value = value
        self._token: Token[V] | None = None
        self._entered = False

    def __enter__(self) -> None:
        if self._entered:  # one token per object: a second block would reset the wrong one
            raise RuntimeError("a Holding block is entered once: make another")
        self._entered = True
        if self._var.get() is not self._value:
            self._token = self._var.set(self._value)

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            self._var.reset(self._token)
            self._token = None


@runtime_checkable
class Connector(Protocol):
    """The whole interface the core uses. ``BaseConnector`` supplies the batch defaults."""

    @property
    def scheme(self) -> str: ...
    @property
    def capabilities(self) -> Capabilities: ...

    async def get(self, key: str) -> Buffer | None: ...
    async def put(self, key: str, data: BufferParts) -> None: ...
    async def exists(self, key: str) -> bool: ...
    async def delete(self, key: str) -> bool: ...
    async def close(self) -> None: ...

    async def get_into(self, key: str, alloc: Allocator) -> memoryview | None: ...
    async def get_many(self, keys: Sequence[str]) -> list[Buffer | None]: ...
    async def put_many(self, items: Sequence[tuple[str, BufferParts]]) -> None: ...
    async def exists_many(self, keys: Sequence[str]) -> list[bool]: ...
    def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]: ...
    async def ping(self) -> bool: ...
    def usage(self) -> tuple[int, int | None]: ...


# The methods a layer must forward; tests/test_layers.py checks every layer against this list.
PROTOCOL_METHODS: tuple[str, ...] = (
    "get",
    "put",
    "exists",
    "delete",
    "close",
    "get_into",
    "get_many",
    "put_many",
    "exists_many",
    "list",
    "ping",
    "usage",
)


def as_parts(data: BufferParts) -> list[memoryview]:
    """The scatter list of ``data`` as byte-format memoryviews (no copies)."""
    if isinstance(data, bytes | bytearray | memoryview):
        return [_byte_view(data)]
    return [_byte_view(p) for p in data]


def _byte_view(part: Buffer) -> memoryview:
    # Every put passes its parts through here several times (the tier, the metrics layer, the
    # connector): a view that is already flat bytes is returned as it is, without a new cast.
    if type(part) is memoryview and part.format == "B" and part.ndim == 1 and part.c_contiguous:
        return part
    return memoryview(part).cast("B")


def parts_len(data: BufferParts) -> int:
    """The number of bytes in ``data``."""
    if type(data) is bytes:
        return len(data)
    return sum(p.nbytes for p in as_parts(data))


def join_parts(data: BufferParts) -> bytes:
    """One ``bytes`` holding the whole object (a copy; for backends that need one value)."""
    if isinstance(data, bytes):
        return data
    return b"".join(as_parts(data))


class BaseConnector:
    """Defaults for everything beyond the five core methods, written once.

    Subclasses set ``scheme`` and ``capabilities`` and implement get/put/exists/delete/close;
    they override a batch method only when the backend can do it faster.
    """

    scheme: ClassVar[str] = ""
    capabilities: Capabilities = Capabilities()
    batch_concurrency: int = 16

    async def get(self, key: str) -> Buffer | None:
        raise NotImplementedError

    async def put(self, key: str, data: BufferParts) -> None:
        raise NotImplementedError

    async def exists(self, key: str) -> bool:
        raise NotImplementedError

    async def delete(self, key: str) -> bool:
        raise NotImplementedError

    async def close(self) -> None:
        return None

    async def get_into(self, key: str, alloc: Allocator) -> memoryview | None:
        """Read into a buffer from ``alloc``; falls back to a plain get when alloc says no.

        Connectors with ``capabilities.zero_copy`` override this to read straight into the
        buffer; this default costs one extra copy.
        """
        data = await self.get(key)
        if data is None:
            return None
        src = memoryview(data).cast("B")
        dst = alloc(src.nbytes)
        if dst is None:
            return src
        dst[:] = src
        return dst

    async def _each(self, count: int, call: Callable[[int], Awaitable[T]]) -> list[T]:
        """``[await call(i) for i in range(count)]`` with at most ``batch_concurrency`` calls
        in flight, made by as many workers that each take the next index (no task per call:
        a batch of 4096 keys costs 16 tasks). The first failure cancels the calls in flight
        and is raised once they have ended, so a dead backend fails a batch after one
        timeout, not after one per key."""
        results: list[T | None] = [None] * count
        indices = iter(range(count))

        async def worker() -> None:
            for i in indices:  # shared: each index goes to one worker
                results[i] = await call(i)

        width = min(self.batch_concurrency, count)
        workers = [asyncio.ensure_future(worker()) for _ in range(width)]
        try:
            await asyncio.gather(*workers)
        except BaseException:
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            raise
        return results  # type: ignore[return-value]  # every index was filled

    async def _bounded(self, calls: Sequence[Awaitable[T]]) -> list[T]:
        """Await ``calls`` with at most ``batch_concurrency`` in flight (see ``_each``)."""
        started = [False] * len(calls)

        def start(i: int) -> Awaitable[T]:
            started[i] = True
            return calls[i]

        try:
            return await self._each(len(calls), start)
        finally:
            for call, began in zip(calls, started, strict=True):
                close = getattr(call, "close", None)
                if not began and close is not None:
                    close()  # a coroutine never awaited, after a failure: no warning

    async def get_many(self, keys: Sequence[str]) -> list[Buffer | None]:
        return await self._each(len(keys), lambda i: self.get(keys[i]))

    async def put_many(self, items: Sequence[tuple[str, BufferParts]]) -> None:
        await self._each(len(items), lambda i: self.put(*items[i]))

    async def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """One ``exists`` per key, ``batch_concurrency`` at a time: what object stores
        without a batch HEAD (S3, GCS, Azure, OpenDAL) answer with."""
        return await self._each(len(keys), lambda i: self.exists(keys[i]))

    def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        raise Unsupported(f"{self.scheme}:// cannot list its objects")

    async def ping(self) -> bool:
        await self.exists("kvgate-ping")
        return True

    def usage(self) -> tuple[int, int | None]:
        """(bytes stored, capacity) as far as the connector knows; (0, None) if it doesn't."""
        return (0, None)

    async def __aenter__(self) -> BaseConnector:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
