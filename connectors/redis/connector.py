"""The Redis connectors: one class for redis://, rediss://, unix://, redis+sentinel:// and
redis+cluster:// (URL forms and options: ``connectors.redis.config``).

Objects are stored by ``gateway.parts.StripedObjects`` on the primitives of ``backend``:

- keys live under ``namespace`` (default ``kvgate:``): an object's main key is
  ``{ns}o:{utf-8 key}`` and its parts ``{ns}p:{gen}:{i}``. A key is its UTF-8 bytes, so odd keys
  cannot collide; on a cluster a ``{...}`` inside a key is a hash tag, which only decides the
  main key's slot (parts spread over every slot).
- up to ``inline_max`` bytes (default ``part_size``, 4 MiB) an object is one value under its
  main key, written by one commit: atomic by itself.
- a larger one is cut into ``part_size`` parts, written in parallel (``stripe_concurrency`` at
  a time) with a pending TTL, then committed by one write of a small manifest to the main key
  (the atomic swap), then made durable by ``PERSIST``. A reader sees the old object or the new
  one; a part missing at read time (evicted, deleted, expired) makes the whole get a miss; the
  parts of a superseded or deleted object are removed.
- a commit (and a delete) is one ``MULTI`` transaction that also reads the first bytes of the
  value it replaces, so that it learns whether that was a manifest without the server sending
  a replaced inline object back (``backend``).
- parts, commits and main-key reads move over the fast path (``fastpath``): values are
  written from the caller's memory and read straight into the caller's buffer, so
  ``get_into`` is zero-copy (``get`` reads into a new buffer). With ``fast_path=False`` all
  goes through redis-py (one more copy each way).
- ``exists`` checks the main key only: an object whose parts were evicted exists until a get
  finds it incomplete.
- ``list`` is ``SCAN MATCH`` over main keys with the prefix escaped (``*?[]\\`` are literal),
  sizes from each value's first bytes and ``STRLEN``.

Timeouts: every socket operation has ``socket_timeout`` (default 30 s, sized for large values),
connecting ``socket_connect_timeout`` (2 s). redis-py does not retry; the Store's layers do.
At most ``max_connections`` redis-py commands run at once (one connection each, per node on a
cluster), and the fast path keeps at most ``max_connections`` connections per node.
``ttl`` gives every object a server-side expiry. ``min_replicas_ack`` makes a put wait until
that many replicas have it (``WAIT``), so an acknowledged put survives a failover.
"""

from __future__ import annotations

import builtins
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Self

from connectors._options import parse_options
from connectors.redis.backend import RedisParts, write_check
from connectors.redis.client import RedisClient
from connectors.redis.config import MIN_PART_SIZE, RedisOptions, Target, resolve
from connectors.redis.fastpath import FOREIGN, MISS, TOO_LARGE, FastPath
from gateway.client_baseline import baseline_objects, timed_put_get
from gateway.connector import Allocator, BaseConnector
from gateway.errors import GatewayError
from gateway.parts import (
    INLINE,
    MANIFEST_SIZE,
    ForeignValue,
    MalformedValue,
    StripedObjects,
    ValueOverReadLimit,
    parse_head,
)
from gateway.types import Buffer, BufferParts, Capabilities, ObjectInfo

log = logging.getLogger(__name__)
_GLOB_SPECIAL = frozenset(b"*?[]\\")
_LIST_BATCH = 256


def glob_escape(raw: bytes) -> bytes:
    """``raw`` as a literal in a Redis MATCH pattern."""
    return b"".join(b"\\" + bytes([c]) if c in _GLOB_SPECIAL else bytes([c]) for c in raw)


def _fresh(size: int) -> memoryview | None:
    return None  # get_into then reads into a new buffer


async def _next(it: AsyncIterator[bytes]) -> bytes | None:
    try:
        return await anext(it)
    except StopAsyncIteration:
        return None


class RedisConnector(BaseConnector):
    """Objects on Redis (standalone, TLS, unix socket, Sentinel or Cluster); module docs."""

    def __init__(self, target: Target, options: RedisOptions) -> None:
        self.target = target
        self.options = options
        self.client = RedisClient(target, options)
        self.fast = (
            FastPath(self.client, per_node=options.max_connections) if options.fast_path else None
        )
        self.backend = RedisParts(
            self.client,
            self.fast,
            stripe_concurrency=options.stripe_concurrency,
            min_replicas_ack=options.min_replicas_ack,
            replicas_ack_timeout=options.replicas_ack_timeout,
        )
        ns = options.namespace.encode()
        self._main_prefix = ns + b"o:"
        self.parts_prefix = ns + b"p:"
        self.objects = StripedObjects(
            self.backend,
            parts_prefix=self.parts_prefix,
            part_size=options.part_size,
            inline_max=options.effective_inline_max,
            min_part_size=MIN_PART_SIZE,
        )
        self.capabilities = Capabilities(
            batch=True, list=True, ttl=True, zero_copy=True, persistent=True
        )
        self._closed = False

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Self:
        opts = parse_options(RedisOptions, url, options)
        return cls(resolve(url, opts), opts)

    @property
    def scheme(self) -> str:  # type: ignore[override]
        """The URL scheme this instance serves (one class serves five)."""
        return self.target.scheme

    def __repr__(self) -> str:
        return f"RedisConnector({self.target.redacted})"

    def main_key(self, key: str) -> bytes:
        """The Redis key of ``key``'s object (its inline value or its manifest)."""
        return self._main_prefix + key.encode("utf-8", "surrogatepass")

    # -- the contract ---------------------------------------------------------------------

    async def get(self, key: str) -> Buffer | None:
        return await self.get_into(key, _fresh)

    async def get_into(self, key: str, alloc: Allocator) -> memoryview | None:
        main = self.main_key(key)
        if self.fast is None:
            return await self.objects.get_into(main, alloc)
        # The fast path reads an inline object straight into alloc's buffer, and anything
        # short enough to be a manifest whole; the rest is StripedObjects.get_into's.
        got = await self.fast.read_object(main, alloc, INLINE, MANIFEST_SIZE)
        if got is None:  # the cluster slot moved: redis-py follows it
            return await self.objects.get_into(main, alloc)
        if got == MISS:
            return None
        if got == FOREIGN:
            raise ForeignValue(f"{self!r}: {key!r} holds a value kvgate did not write")
        if got == TOO_LARGE:
            raise ValueOverReadLimit(f"{self!r}: {key!r} holds more than a reader takes")
        assert isinstance(got, tuple)
        kind, value = got
        if kind == "inline":
            assert isinstance(value, memoryview)
            return value
        return await self.objects.get_from_head(value, alloc, main)

    async def put(self, key: str, data: BufferParts) -> None:
        with write_check() as check:
            await self.objects.put(self.main_key(key), data, ttl=self.options.ttl)
        check.raise_if_any()

    async def exists(self, key: str) -> bool:
        main = self.main_key(key)
        found: int = await self.client.run("exists", lambda: self.client.redis.exists(main))
        return found > 0

    async def exists_many(self, keys: Sequence[str]) -> builtins.list[bool]:
        if not keys:
            return []
        prefix = self._main_prefix  # main_key's work, inlined: 4096 calls show in a lookup
        mains = [prefix + k.encode("utf-8", "surrogatepass") for k in keys]
        if self.fast is not None:
            flags = await self.fast.exists_many(mains)
            if flags is not None:
                return flags
        # Without the fast path, or a slot moved: redis-py follows redirections.
        redis = self.client.redis

        async def pipeline() -> builtins.list[Any]:
            async with redis.pipeline(transaction=False) as pipe:
                for main in mains:
                    pipe.exists(main)
                return builtins.list(await pipe.execute())

        return [bool(n) for n in await self.client.run("exists", pipeline)]

    async def delete(self, key: str) -> bool:
        return await self.objects.delete(self.main_key(key))

    async def ping(self) -> bool:
        await self.client.run("ping", lambda: self.client.redis.ping())
        return True

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.fast is not None:
            await self.fast.close()
        await self.client.close()

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        """Objects whose key starts with ``prefix``, in no particular order (SCAN: a key may
        show twice if the server rehashes meanwhile; keys added meanwhile may be missed)."""
        start = self._main_prefix + prefix.encode("utf-8", "surrogatepass")
        pattern = glob_escape(start) + b"*"
        scan = self.client.redis.scan_iter(match=pattern, count=1000)
        try:
            batch: builtins.list[bytes] = []
            while True:
                key = await self.client.run("list", lambda: _next(scan))
                if key is not None:
                    batch.append(key)
                if batch and (key is None or len(batch) >= _LIST_BATCH):
                    for info in await self._sizes(batch):
                        yield info
                    batch = []
                if key is None:
                    return
        finally:
            await scan.aclose()  # type: ignore[attr-defined]

    async def _sizes(self, mains: builtins.list[bytes]) -> builtins.list[ObjectInfo]:
        redis = self.client.redis

        async def pipeline() -> builtins.list[Any]:
            async with redis.pipeline(transaction=False) as pipe:
                for main in mains:
                    pipe.getrange(main, 0, MANIFEST_SIZE - 1)
                    pipe.strlen(main)
                return builtins.list(await pipe.execute())

        replies = await self.client.run("list", pipeline)
        out = []
        skip = len(self._main_prefix)
        for i, main in enumerate(mains):
            head, length = replies[2 * i], replies[2 * i + 1]
            if not length:
                continue  # deleted since the scan (a stored object has its tag byte at least)
            try:
                key = main[skip:].decode("utf-8", "surrogatepass")
                manifest = parse_head(head)
            except (UnicodeDecodeError, MalformedValue) as exc:
                log.debug("%r: skipping %r in list: %s", self, main, exc)
                continue
            out.append(ObjectInfo(key, length - 1 if manifest is None else manifest.total))
        return out

    # -- benchmark baseline ---------------------------------------------------------------

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
        """(put GB/s, get GB/s) of plain redis-py: one SET and one GET per object."""
        opts = parse_options(RedisOptions, url, options)
        client = RedisClient(resolve(url, opts), opts)
        redis = client.redis
        objects = baseline_objects(size, payloads)
        keys = [f"kvgate-baseline/{i}" for i in range(count)]

        async def get(i: int) -> int | None:
            got = await redis.get(keys[i])
            return None if got is None else len(got)

        try:
            return await timed_put_get(
                lambda i: redis.set(keys[i], objects[i % len(objects)]),
                get,
                size=size,
                count=count,
                concurrency=concurrency,
            )
        except GatewayError:
            raise
        except Exception as exc:
            raise client.error(exc, "baseline") from exc
        finally:
            try:
                for key in keys:
                    await redis.delete(key)
            finally:
                await client.close()
