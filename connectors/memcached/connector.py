"""``memcached://host:port`` — objects on a memcached server (URL and options: ``config``).

Keys. memcached keys are at most 250 bytes with no whitespace or control characters, and
kvgate keys are any string. So every object's memcached key is
``{namespace}o:{base64url(blake2b-128(utf-8 key))}`` (24 characters after the namespace) and
parts are ``{namespace}p:{random gen}:{i}``. The real key is stored inside the main value, in a
head before the engine's value: ``b"KVMC" + u32 length + key + value``. A read whose head names
another key (a hash collision) is a miss, and a delete leaves that value alone, so a
collision can never return or remove another key's object. ``exists`` trusts the 128-bit hash
(it asks ``mg``, which sends no value back).

Objects. ``gateway.parts.StripedObjects`` stores them on the primitives of ``ObjectParts``:

- up to ``inline_max`` bytes (default 4 MiB, or what one item holds) an object is its main
  value alone;
- larger ones are cut into ``part_size`` parts (default 1 MiB; at most the item limit minus
  memcached's overhead), written in parallel over ``stripe_concurrency`` connections with a
  pending expiry, then committed by one compare-and-swap of the main value;
- ``split=false`` keeps every object one item: larger ones are refused with a CapacityError
  and ``capabilities.max_object_size`` says where that starts.

Atomicity. memcached has no "set and return the old value", so ``swap`` is a compare-and-swap
loop. It tries ``add`` first: one round trip for a new key, the common case (chunks are named
by their content). If the key exists, it reads the main key's CAS (meta ``mg <key> c s``) and
writes with ``cas``, again when another writer got in between; an overwrite so sends its
value twice. A replaced value of up to 64 KiB (every manifest) is fetched with ``gets`` and
used only if its CAS is the one read, so the value a successful ``cas`` replaced is exactly
the one fetched: each superseded manifest goes to one writer only, and its parts are deleted
once. A larger value is an inline object with nothing to clean up and is not fetched.
``take`` (delete) is ``gets`` then meta ``md <key> C<cas>``: it deletes only the value it
read, so a concurrent overwrite is never deleted by mistake (it retries, and deletes the
newer value). A reader sees the old object or the new one whole; a part that memcached
evicted or that expired makes the whole read a miss (the engine checks every part), and one
that a concurrent overwrite deleted makes it read the newer object.

Reads. ``get_into`` receives an inline object straight into the caller's buffer (the head is
split off as the value arrives) and parts straight into their slices of it; only a manifest
costs a second, small read of the main key, by the engine.

Expiry. ``ttl`` gives every object a server-side expiry; parts are written with the engine's
pending TTL and made durable (``touch`` to 0, or the object's TTL plus the margin) after the
commit. Exptimes over 30 days are sent as absolute unix times (memcached's rule), which
assumes the server's clock agrees with ours. memcached may also evict anything at any time
under memory pressure: that is a miss, never wrong bytes.

Timeouts and errors: see ``client``. Every call has ``timeout`` seconds of silence at most.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import hashlib
import random
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from connectors._options import parse_options
from connectors.memcached.client import MemcachedClient
from connectors.memcached.config import (
    ITEM_OVERHEAD,
    MIN_PART_SIZE,
    Address,
    MemcachedOptions,
    exptime,
    parse_url,
)
from gateway.connector import Allocator, BaseConnector, as_parts
from gateway.errors import CapacityError, ForeignObject, Unavailable
from gateway.parts import INLINE, MANIFEST_SIZE, StripedObjects
from gateway.types import Buffer, BufferParts, Capabilities

_HEAD = struct.Struct("<4sI")
_MAGIC = b"KVMC"
_SWAP_ATTEMPTS = 100
_SMALL = 64 * 1024  # a main value this small is fetched whole (manifests are)
_UNREAD_INLINE = bytes([INLINE])


class ForeignValue(ForeignObject):
    """A main key holds a value without kvgate's head (something else wrote it): left in place."""


def value_head(key: bytes) -> bytes:
    """What precedes the engine's value in a main value: magic, key length, key."""
    return _HEAD.pack(_MAGIC, len(key)) + key


def split_value(value: bytearray) -> tuple[memoryview, memoryview]:
    """(the key a main value belongs to, the engine's value); ``ForeignValue`` if not ours."""
    view = memoryview(value)
    if view.nbytes < _HEAD.size:
        raise ForeignValue(f"a value of {view.nbytes} bytes has no head")
    magic, length = _HEAD.unpack_from(view)
    if magic != _MAGIC or _HEAD.size + length > view.nbytes:
        raise ForeignValue("a value without kvgate's head under a kvgate key")
    return view[_HEAD.size : _HEAD.size + length], view[_HEAD.size + length :]


class ObjectParts:
    """``PartBackend`` for one object on memcached: the main value carries the object's key,
    checked on every read (module docs). One instance per call; it holds no state."""

    def __init__(self, client: MemcachedClient, key: bytes) -> None:
        self.client = client
        self.key = key
        self.head = value_head(key)

    async def read(self, key: bytes) -> Buffer | None:
        found = await self.client.get(key)
        if found is None:
            return None
        owner, value = split_value(found[0])
        return value if owner == self.key else None  # another key's: a collision is a miss

    async def read_parts_into(self, keys: Sequence[bytes], dsts: Sequence[memoryview]) -> bool:
        return await self.client.get_many_into(keys, dsts)

    async def write_parts(self, items: Sequence[tuple[bytes, memoryview]], ttl: float) -> None:
        await self.client.set_many(items, exptime(ttl))

    async def swap(
        self, key: bytes, value: Sequence[memoryview], ttl: float | None
    ) -> Buffer | None:
        """Set ``key`` and return what it replaced, by compare-and-swap (module docs).

        An inline object's bytes are not fetched: the engine only cleans up after manifests,
        so a large replaced value comes back as the bare inline tag (an empty inline object).
        """
        new: list[Buffer] = [self.head, *value]
        expires = exptime(ttl)
        # Most puts are of new keys (chunks are named by their content): one round trip.
        # An overwrite pays for it by sending the value twice.
        if await self.client.store(b"add", key, new, expires):
            return None
        for attempt in range(_SWAP_ATTEMPTS):
            current = await self.client.cas_and_size(key)
            if current is None:
                if await self.client.store(b"add", key, new, expires):
                    return None
            else:
                cas, size = current
                fetch = size <= max(_SMALL, len(self.head) + MANIFEST_SIZE)  # our manifests
                old = await self._small_value(key, cas) if fetch else _UNREAD_INLINE
                if old is not None and await self.client.store(b"cas", key, new, expires, cas):
                    return old
            await _back_off(attempt)  # another writer got in between: look again
        raise Unavailable(f"{self.client.name}: {_SWAP_ATTEMPTS} writers in a row got in first")

    async def _small_value(self, key: bytes, cas: int) -> Buffer | None:
        """The engine's value under ``key`` if its CAS is still ``cas``; None if it changed."""
        found = await self.client.get(key, with_cas=True)
        if found is None or found[1] != cas:
            return None
        return _engine_value(found[0])

    async def take(self, key: bytes) -> Buffer | None:
        for attempt in range(_SWAP_ATTEMPTS):
            found = await self.client.get(key, with_cas=True)
            if found is None:
                return None
            old, cas = found
            try:
                owner, value = split_value(old)
            except ForeignValue:
                owner, value = memoryview(self.key), memoryview(old)  # garbage: remove it
            if owner != self.key:
                return None  # another key's object (a hash collision): not ours to delete
            outcome = await self.client.delete_if(key, cas)
            if outcome == "deleted":
                return value
            if outcome == "missing":
                return None
            await _back_off(attempt)  # overwritten since the gets: delete the new value
        raise Unavailable(f"{self.client.name}: {_SWAP_ATTEMPTS} writers in a row got in first")

    async def set_ttl(self, keys: Sequence[bytes], ttl: float | None) -> None:
        await self.client.touch_many(keys, exptime(ttl))

    async def remove(self, keys: Sequence[bytes]) -> None:
        await self.client.delete_many(keys)


def _engine_value(old: bytearray) -> Buffer:
    """The engine's value inside a replaced main value, so that its parts are cleaned up
    (also when it was another key's: it is gone now); a foreign value as it is."""
    try:
        return split_value(old)[1]
    except ForeignValue:
        return old  # the engine sees no manifest in it and cleans nothing


def _fresh_memory(size: int) -> memoryview | None:
    return None  # get_into then reads into a new buffer of exactly the object's size


async def _back_off(attempt: int) -> None:
    if attempt >= 3:  # lost several races in a row: let the winners finish
        await asyncio.sleep(random.uniform(0, min(0.05, 0.001 * 2**attempt)))


@dataclass(frozen=True, slots=True)
class _Object:
    """One call's view of an object: the engine on a backend that knows the object's key,
    its main key, and how many bytes of object its main value can hold."""

    engine: StripedObjects
    backend: ObjectParts
    main: bytes
    room: int


class MemcachedConnector(BaseConnector):
    """Objects on one memcached server; see the module docs."""

    scheme: ClassVar[str] = "memcached"

    def __init__(self, address: Address, options: MemcachedOptions | None = None) -> None:
        self.address = address
        self.options = options = options or MemcachedOptions()
        self.client = MemcachedClient(
            address.host,
            address.port,
            name=str(address),
            pool_size=options.pool_size,
            stripes=options.stripe_concurrency,
            timeout=options.timeout,
            connect_timeout=options.connect_timeout,
        )
        ns = options.namespace.encode()
        self._main_prefix = ns + b"o:"
        self.parts_prefix = ns + b"p:"
        self.part_size = options.effective_part_size
        self.inline_max = options.effective_inline_max
        self.ttl = options.ttl
        self.capabilities = Capabilities(
            batch=True,  # exists_many is one pipelined round trip
            ttl=True,
            zero_copy=True,  # values are received straight into the caller's buffer
            persistent=True,  # outlives the gateway (not a server restart; may be evicted)
            max_object_size=options.declared_max_object_size,
            max_key_length=options.item_limit - ITEM_OVERHEAD - _HEAD.size - MANIFEST_SIZE,
        )

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Self:
        address = parse_url(url)
        return cls(address, parse_options(MemcachedOptions, url, options))

    def __repr__(self) -> str:
        return f"MemcachedConnector({self.address})"

    def main_key(self, key: str) -> bytes:
        """The memcached key of ``key``'s object: the namespace and a hash (module docs)."""
        digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        return self._main_prefix + base64.urlsafe_b64encode(digest).rstrip(b"=")

    def _object(self, key: str) -> _Object:
        backend = ObjectParts(self.client, key.encode("utf-8", "surrogatepass"))
        room = self.options.item_limit - ITEM_OVERHEAD - len(backend.head) - 1  # 1: the tag
        engine = StripedObjects(
            backend,
            parts_prefix=self.parts_prefix,
            part_size=self.part_size,
            inline_max=max(0, min(self.inline_max, room)),
            min_part_size=MIN_PART_SIZE,
        )
        return _Object(engine, backend, self.main_key(key), room)

    # -- the contract ---------------------------------------------------------------------

    async def get(self, key: str) -> Buffer | None:
        return await self.get_into(key, _fresh_memory)

    async def get_into(self, key: str, alloc: Allocator) -> memoryview | None:
        obj = self._object(key)
        # An inline object of this key is received straight into alloc's buffer: the main
        # value is read with its head split off. Anything else (a manifest, another key's
        # value, garbage) is left to the engine, which reads the main key again.
        inline_head = obj.backend.head + bytes([INLINE])
        found = await self.client.get_into_after(obj.main, inline_head, alloc)
        if found is None:
            return None
        inline, value = found
        if inline:
            return value
        return await obj.engine.get_into(obj.main, alloc)

    async def put(self, key: str, data: BufferParts) -> None:
        parts = as_parts(data)
        size = sum(p.nbytes for p in parts)
        obj = self._object(key)
        limit = self.options.max_object_size
        if limit is not None and size > limit:
            raise CapacityError(f"{self!r}: {size} bytes exceed max_object_size ({limit})")
        if obj.room + 1 < MANIFEST_SIZE:
            raise CapacityError(
                f"{self!r}: a key of {len(key)} characters leaves no room in a memcached item "
                f"(item_limit {self.options.item_limit})"
            )
        if size > obj.room and not self.options.split:
            raise CapacityError(
                f"{self!r}: an object of {size} bytes does not fit one memcached item "
                f"(item_limit {self.options.item_limit} holds {obj.room} bytes of object for "
                "this key) and split=false; set split=true to store it as parts, or raise "
                "the server's -I and item_limit"
            )
        await obj.engine.put(obj.main, parts, ttl=self.ttl)

    async def exists(self, key: str) -> bool:
        return (await self.exists_many([key]))[0]

    async def exists_many(self, keys: Sequence[str]) -> builtins.list[bool]:
        return await self.client.exists_many([self.main_key(k) for k in keys])

    async def delete(self, key: str) -> bool:
        obj = self._object(key)
        return await obj.engine.delete(obj.main)

    async def ping(self) -> bool:
        await self.client.version()
        return True

    async def close(self) -> None:
        await self.client.close()

    # -- benchmark ------------------------------------------------------------------------

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
        """(put GB/s, get GB/s) of plain aiomcache: one ``set`` and one ``get`` per object."""
        from connectors.memcached.baseline import aiomcache_baseline

        address = parse_url(url)
        opts = parse_options(MemcachedOptions, url, options)
        return await aiomcache_baseline(
            address.host,
            address.port,
            size=size,
            count=count,
            concurrency=concurrency,
            payloads=payloads,
            seconds_per_object=opts.timeout,
        )
