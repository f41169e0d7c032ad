"""``obstore+s3://bucket/prefix``: S3 and compatible stores through obstore.

obstore is a Rust S3 client (the ``object_store`` crate): it signs and moves the bytes in its
own threads without the GIL, where ``s3://`` (aioboto3 + botocore) runs its request building,
signing and body handling as Python on the event loop. ``benchmarks/s3_clients.py`` measures
the two clients side by side.

- Object names are ``s3://``'s (``connectors/object_names.py``), long keys' metadata entry too
  (``x-amz-meta-kvgate-key``), so the two connectors read and list each other's objects and a
  deployment can move between them without moving data.
- Puts: one PutObject from the caller's buffer (S3 makes it atomic). A multipart upload only
  above ``multipart_threshold`` (off by default; see config.py for why).
- Gets: one GET. Its headers give the size, checked against the reader's limit before any
  body byte is buffered; the body lands in obstore's buffer, which ``get`` returns as is and
  ``get_into`` copies once into the caller's (in a thread for large objects).
- Timeouts: obstore bounds each request by ``request_timeout`` and ``connect_timeout``; each
  call is bounded on this side too, by what its requests may take: ``request_timeout`` times
  ``max_attempts`` (obstore's retries), and for a multipart upload times its rounds of parts.
- Cancellation: obstore drops a cancelled request in its own thread, shortly after the caller
  has moved on. A put cancelled after its last body byte left may still land, possibly with
  bytes its (reused) buffer held by then; the Store's frame checksum refuses such an object
  on read, as it refuses any corrupted one.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar, Self, TypeVar

import obstore
from obstore import exceptions as ox
from obstore.store import S3Store

from connectors import object_names as names
from connectors.object_store import OBJECT_STORE_CAPABILITIES, ObjectStoreConnector
from connectors.obstore.config import SCHEME, ObstoreS3Options, parse
from connectors.obstore.errors import is_missing, obstore_errors
from gateway.client_baseline import baseline_objects, timed_put_get
from gateway.connector import Allocator, FillHook, fill_hook, read_limit
from gateway.errors import ConfigError, OverReadLimit, Unavailable
from gateway.thread_jobs import in_thread
from gateway.types import ObjectInfo

T = TypeVar("T")

COPY_IN_THREAD_BYTES = 4 << 20
"""A get's copy into the caller's buffer runs in a thread from this size: the store's own
threshold for CPU work on the loop (``gateway.tiers.OFFLOAD_BYTES``)."""
COPY_STEP = 1 << 20
_COPIES = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvgate-obstore-copy")


def _copy(dst: memoryview, src: memoryview, filled: FillHook | None) -> None:
    """``dst[:] = src`` a MiB at a time, each reported to the store's checksum while it is
    still in the CPU cache (a separate pass over a 32 MiB object cost 3.3 ms here)."""
    for start in range(0, src.nbytes, COPY_STEP):
        stop = min(start + COPY_STEP, src.nbytes)
        dst[start:stop] = src[start:stop]
        if filled is not None:
            filled(start, stop)


def open_store(bucket: str, options: ObstoreS3Options) -> S3Store:
    """obstore's client; what it refuses (a certificate it cannot parse, ...) is a
    ``ConfigError`` that names no secret (its messages hold none)."""
    try:
        return S3Store(bucket, **options.store_arguments())
    except (ValueError, ox.BaseError) as exc:
        raise ConfigError(f"{SCHEME}://{bucket}: obstore refused the options: {exc}") from None


class ObstoreS3Connector(ObjectStoreConnector):
    scheme: ClassVar[str] = SCHEME
    capabilities = OBJECT_STORE_CAPABILITIES

    def __init__(self, url: str, **options: Any) -> None:
        location, self.options = parse(url, options)
        self.bucket = location.bucket
        self.prefix = location.prefix
        self.batch_concurrency = self.options.batch_concurrency
        self._track_objects(location.prefix)
        self._store = open_store(self.bucket, self.options)
        self._checked: asyncio.Future[None] | None = None
        # A request's bound, with the attempts obstore may make of it.
        self._budget = self.options.request_timeout * self.options.max_attempts

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Self:
        return cls(url, **options)

    def __repr__(self) -> str:
        endpoint = f" at {self.options.endpoint_url}" if self.options.endpoint_url else ""
        return f"ObstoreS3Connector({SCHEME}://{self.bucket}/{self.prefix}{endpoint})"

    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        with obstore_errors(f"{self!r} {what}", self.bucket, self._budget):
            yield

    async def _call(self, what: str, call: Awaitable[T], rounds: int = 1) -> T:
        """Await one obstore call of ``rounds`` requests one after another, its errors
        mapped."""
        with self._errors(what):
            async with asyncio.timeout(self._budget * rounds):
                return await call

    async def _unless_missing(self, what: str, call: Awaitable[T]) -> T | None:
        """``_call`` of a request about one object; None when there is no such object."""
        with self._errors(what):
            async with asyncio.timeout(self._budget):
                try:
                    return await call
                except Exception as exc:
                    if is_missing(exc):
                        return None
                    raise

    async def _ready(self) -> None:
        """The bucket answers (once, on first use): a wrong bucket or secret is a clear
        ``ConfigError`` at once rather than a miss on every get."""
        if not self.options.check_bucket:
            return
        if self._checked is None:
            self._checked = asyncio.ensure_future(self._check_bucket())
        try:
            await asyncio.shield(self._checked)
        except BaseException:
            checked = self._checked
            if checked.done() and (checked.cancelled() or checked.exception() is not None):
                self._checked = None  # a server that was down may be up at the next call
            raise

    async def _check_bucket(self) -> None:
        pages = obstore.list(self._store, prefix=self.prefix or None, chunk_size=1)
        await self._call("LIST (bucket check)", anext(aiter(pages), None))

    # -- the object-store hooks --------------------------------------------------------------

    async def _download(self, name: str, alloc: Allocator) -> memoryview | None:
        await self._ready()
        where = f"GET {names.shown(name)}"
        result = await self._unless_missing(where, obstore.get_async(self._store, name))
        if result is None:
            return None
        size = int(result.meta["size"])
        limit = read_limit()
        if limit is not None and size > limit:  # anyone's object: never an allocation
            raise OverReadLimit(
                f"{names.shown(name)} is {size} bytes, over the {limit} a reader takes"
            )
        body = memoryview(await self._call(where, result.bytes_async()))
        if body.nbytes != size:
            raise Unavailable(f"{self!r} {where}: {body.nbytes} of {size} bytes arrived")
        dst = alloc(size)
        if dst is None:
            return body  # obstore's own buffer, no copy
        if dst.nbytes != size:
            raise ValueError(f"alloc({size}) gave {dst.nbytes} bytes")
        dst = dst.cast("B") if dst.format != "B" else dst
        filled = fill_hook(alloc)
        if size < COPY_IN_THREAD_BYTES:
            _copy(dst, body, filled)
        else:
            await in_thread(_COPIES, lambda: _copy(dst, body, filled))
        return dst

    async def _stat(self, name: str) -> object | None:
        await self._ready()
        return await self._unless_missing(
            f"HEAD {names.shown(name)}", obstore.head_async(self._store, name)
        )

    async def _upload(self, name: str, parts: list[memoryview], meta: dict[str, str]) -> None:
        await self._ready()
        size = sum(p.nbytes for p in parts)
        threshold = self.options.multipart_threshold
        multipart = threshold is not None and size > threshold
        # One buffer goes as it is; several are joined by obstore (in Rust, off the loop).
        payload: Any = parts[0] if len(parts) == 1 else parts
        call = obstore.put_async(
            self._store,
            name,
            payload,
            attributes=dict(meta) if meta else None,
            use_multipart=multipart,
            chunk_size=self.options.part_size,
            max_concurrency=self.options.max_concurrency,
        )
        rounds = 1
        if multipart:  # the parts go max_concurrency at a time, then the completion
            parts_count = -(-size // self.options.part_size)
            rounds = -(-parts_count // self.options.max_concurrency) + 1
        await self._call(f"PUT {names.shown(name)}", call, rounds)

    async def _close_client(self) -> None:
        return None  # obstore's connection pool goes with the store object

    # -- writes ------------------------------------------------------------------------------

    async def delete(self, key: str) -> bool:
        """Delete ``key``; whether it existed (a HEAD first: S3's DELETE does not say)."""
        with self._op():
            name = self._name(key)
            if name is None or await self._stat(name) is None:
                return False
            await self._call(f"DELETE {names.shown(name)}", obstore.delete_async(self._store, name))
            return True

    # -- listing (last: ``list`` would shadow the builtin in annotations below it) -----------

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        """Every stored key starting with ``prefix``, with its size, a page at a time.

        A hashed (very long) key is read back from its object's metadata (a GET with no body).
        """
        await self._ready()
        # obstore lists whole path segments ("a/b" means "a/b/..."), while names of a key
        # prefix are string prefixes: list from the last "/" and keep the names that match.
        name_prefix = self._names.list_prefix(prefix)
        directory = name_prefix.rpartition("/")[0]
        pages = aiter(obstore.list(self._store, prefix=directory or None))
        while True:
            with self._op():  # not held across a yield: a consumer may pause or stop anywhere
                page = await self._call(f"LIST {prefix!r}", anext(pages, None))
                if page is None:
                    return
                found = []
                for item in page:
                    name = str(item["path"])
                    if not name.startswith(name_prefix):
                        continue
                    key = await self._key_of(name)
                    if key is not None and key.startswith(prefix):
                        found.append(ObjectInfo(key, int(item["size"])))
            for info in found:
                yield info

    async def _key_of(self, name: str) -> str | None:
        if not self._names.is_hashed(name):
            return self._names.key_of(name)
        where = f"GET (metadata) {names.shown(name)}"
        call = obstore.get_async(self._store, name, options={"head": True})
        result = await self._unless_missing(where, call)
        if result is None:
            return None
        attributes = {k: v for k, v in result.attributes.items() if isinstance(v, str)}
        key = names.key_from_metadata(attributes)
        # Only an object of ours: its name is the one its key maps to.
        return key if key is not None and self._name(key) == name else None

    # -- the benchmark's reference -----------------------------------------------------------

    @classmethod
    async def raw_client_baseline(
        cls,
        url: str,
        options: Mapping[str, Any],
        *,
        size: int,
        count: int,
        concurrency: int,
        payloads: Sequence[bytes] = (),
    ) -> tuple[float, float]:
        """(put GB/s, get GB/s) of plain obstore: ``put_async`` of the bytes and
        ``get_async`` + ``bytes_async`` per object, on a store configured like the tier's."""
        location, opts = parse(url, options)
        store = open_store(location.bucket, opts)
        objects = baseline_objects(size, payloads)
        base = f"{location.prefix}kvgate-baseline/{uuid.uuid4().hex[:12]}-"
        keys = [f"{base}{i}" for i in range(count)]

        async def put(i: int) -> object:
            return await obstore.put_async(store, keys[i], objects[i % len(objects)])

        async def get(i: int) -> int:
            result = await obstore.get_async(store, keys[i])
            return memoryview(await result.bytes_async()).nbytes

        try:
            return await timed_put_get(put, get, size=size, count=count, concurrency=concurrency)
        finally:
            with contextlib.suppress(Exception):
                await obstore.delete_async(store, keys)
