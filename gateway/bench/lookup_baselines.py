"""The raw clients that ``kvgate bench lookup`` times beside ``Store.lookup``: each asks the
deepest tier's server about the same keys the plain way, on a client of its own configured
like the connector's.

By the deepest tier's scheme:

- ``redis``: redis-py's pipelined ``EXISTS`` of the connector's server keys, and, as a floor,
  one ``EXISTS k1 ... kN`` (it answers only a count);
- ``valkey``/``valkeys`` (one server): glide's non-atomic batch of one ``EXISTS`` per key, and
  the same floor;
- ``memcached`` (TCP): aiomcache's ``multi_get`` of the connector's keys, one ``get k1 ... kN``
  (it sends the values back: the bench's objects are 64 bytes);
- ``s3``: aioboto3's ``head_object`` of each object name, as many at once as the connector's
  ``batch_concurrency``;
- ``obstore+s3``: obstore's ``head_async`` of each object name, as many at once;
- ``file``: ``os.stat`` of each object's path in a thread (what reading the directory costs;
  the tier itself answers from its index in memory);
- ``memory`` (the memory tier alone): Python ``in`` over a set of the keys.

Other schemes are measured without a baseline. Clients open in the first (warm-up) round and
close with ``close()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from gateway.store import Store

Timed = Callable[[], Awaitable[object]]


def connector_of(tier: object) -> object:
    """The connector under a tier's layers (for its server keys and paths)."""
    conn = getattr(tier, "connector", tier)
    while hasattr(conn, "inner"):
        conn = conn.inner
    return conn


class LookupBaseline:
    """The raw client of the deepest tier, for one key set (module docs): ``run`` (None when
    the scheme has none) and ``floor`` (None but for Redis and Valkey), with their names."""

    def __init__(self, store: Store, keys: list[str]) -> None:
        self.name: str | None = None
        self.floor_name: str | None = None
        self.run: Timed | None = None
        self.floor: Timed | None = None
        self._close: Callable[[], Awaitable[None]] | None = None
        tiers = store.tiers
        if not tiers:
            wanted = set(keys)
            self.name = "set membership"

            async def member() -> object:
                return [k in wanted for k in keys]

            self.run = member
            return
        conn = connector_of(tiers[-1])
        scheme = getattr(conn, "scheme", "")
        if scheme == "redis" and hasattr(conn, "main_key"):
            self._redis(conn, keys)
        elif scheme in ("valkey", "valkeys") and hasattr(conn, "main_key"):
            self._valkey(conn, keys)
        elif scheme == "memcached" and hasattr(conn, "main_key"):
            self._memcached(conn, keys)
        elif scheme == "s3" and hasattr(conn, "object_name"):
            self._s3(conn, keys)
        elif scheme == "obstore+s3" and hasattr(conn, "object_name"):
            self._obstore(conn, keys)
        elif scheme == "file" and hasattr(conn, "path_for"):
            paths = [conn.path_for(k) for k in keys]
            self.name = "os.stat per key (thread)"

            async def stat_all() -> object:
                return await asyncio.to_thread(lambda: [os.path.exists(p) for p in paths])

            self.run = stat_all

    def _redis(self, conn: Any, keys: list[str]) -> None:
        import redis.asyncio as aredis

        mains = [conn.main_key(k) for k in keys]
        target = conn.target
        (host, port), *_ = target.hosts
        client = aredis.Redis(host=host, port=port, db=target.db, password=target.password)
        self.name = "redis-py pipelined EXISTS"
        self.floor_name = "one EXISTS k1..kN (count only)"

        async def pipelined() -> object:
            async with client.pipeline(transaction=False) as pipe:
                for main in mains:
                    pipe.exists(main)
                return await pipe.execute()

        async def one_command() -> object:
            return await client.exists(*mains)

        async def close() -> None:
            await client.aclose()

        self.run, self.floor, self._close = pipelined, one_command, close

    def _valkey(self, conn: Any, keys: list[str]) -> None:
        """glide, the obvious way: a non-atomic batch (a pipeline) of one EXISTS per key,
        on a client of its own configured like the connector's."""
        from glide import Batch

        from connectors.valkey.client import close_quietly, create_client
        from connectors.valkey.config import glide_config

        mains = [conn.main_key(k) for k in keys]
        opened: list[Any] = []  # connected by the first (warm-up) round
        self.name = "glide pipelined EXISTS"
        self.floor_name = "one EXISTS k1..kN (count only)"

        async def client() -> Any:
            if not opened:
                config = glide_config(conn.endpoint, conn.options)
                opened.append(await create_client(config, conn.endpoint.display))
            return opened[0]

        async def pipelined() -> object:
            batch = Batch(is_atomic=False)
            for main in mains:
                batch.exists([main])
            return await (await client()).exec(batch, raise_on_error=True)

        async def one_command() -> object:
            return await (await client()).exists(mains)

        async def close() -> None:
            for opened_client in opened:
                await close_quietly(opened_client)

        self.run, self.floor, self._close = pipelined, one_command, close

    def _memcached(self, conn: Any, keys: list[str]) -> None:
        import aiomcache

        mains = [conn.main_key(k) for k in keys]
        client = aiomcache.Client(conn.address.host, conn.address.port, pool_size=1)
        self.name = "aiomcache multi_get"

        async def multi_get() -> object:
            return await client.multi_get(*mains)

        async def close() -> None:
            await client.close()

        self.run, self._close = multi_get, close

    def _s3(self, conn: Any, keys: list[str]) -> None:
        from connectors.s3.client import new_session, open_client

        names = [conn.object_name(k) for k in keys]
        stack = contextlib.AsyncExitStack()
        opened: list[Any] = []
        self.name = f"aioboto3 HEAD per key, {conn.batch_concurrency} at once"

        async def head(client: Any, name: str) -> object:
            return await client.head_object(Bucket=conn.bucket, Key=name)

        async def heads() -> object:
            if not opened:
                opened.append(await open_client(new_session(conn.options), conn.options, stack))
            return await _bounded([functools.partial(head, opened[0], n) for n in names], conn)

        self.run, self._close = heads, stack.aclose

    def _obstore(self, conn: Any, keys: list[str]) -> None:
        import obstore

        from connectors.obstore.connector import open_store

        names = [conn.object_name(k) for k in keys]
        store = open_store(conn.bucket, conn.options)
        self.name = f"obstore head_async per key, {conn.batch_concurrency} at once"

        async def heads() -> object:
            calls = [functools.partial(obstore.head_async, store, n) for n in names]
            return await _bounded(calls, conn)

        self.run = heads

    async def close(self) -> None:
        if self._close is not None:
            await self._close()


async def _bounded(calls: Sequence[Timed], conn: Any) -> list[object]:
    """Every call, ``conn.batch_concurrency`` at a time: what a plain client does with a
    semaphore around ``gather``."""
    limit = asyncio.Semaphore(conn.batch_concurrency)

    async def one(call: Timed) -> object:
        async with limit:
            return await call()

    return await asyncio.gather(*(one(c) for c in calls))
