"""``sqlite:///path/tier.db``: a kvgate tier in one SQLite file (see ``database.py``).

SQLite is a blocking library, so every call runs in a thread: one writer thread (SQLite
takes one writer at a time anyway, and a second would only wait on the file lock) and
``readers`` reader threads, each with its own connection; WAL lets the readers run while the
writer writes. Calls waiting for a thread are bounded, so a burst of puts holds at most a few
callers' buffers in the queue, never an unbounded pile.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from gateway.client_baseline import baseline_objects, timed_put_get
from gateway.connector import Allocator, BaseConnector, as_parts, read_limit
from gateway.errors import CapacityError, Unavailable
from gateway.thread_jobs import in_thread
from gateway.types import Buffer, BufferParts, Capabilities, ObjectInfo
from kvgate_sqlite import database
from kvgate_sqlite.options import SqliteOptions, parse_options, parse_url

T = TypeVar("T")
WRITES_WAITING = 4
"""Puts and deletes queued for the writer thread at once, beyond the one it runs."""


class _Threads:
    """A thread pool whose threads each own one connection to the file."""

    def __init__(self, path: Path, opts: SqliteOptions, workers: int, name: str) -> None:
        self._path, self._opts = path, opts
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix=name)
        self.slots = asyncio.Semaphore(workers + WRITES_WAITING)

    def connection(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = database.open_connection(self._path, self._opts)
            self._local.conn = conn
            with self._lock:
                self._all.append(conn)
        return conn

    async def run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """``fn(connection)`` in a thread. A cancelled caller still waits for a started call
        to end (``in_thread``): a put's thread reads the caller's buffers, which the caller
        reuses once this returns."""
        async with self.slots:
            return await in_thread(self.pool, lambda: fn(self.connection()))

    def shutdown(self) -> None:
        """Blocking: waits for running calls, then closes every connection."""
        self.pool.shutdown(wait=True)
        with self._lock:
            for conn in self._all:
                conn.close()
            self._all.clear()


class SqliteConnector(BaseConnector):
    scheme: ClassVar[str] = "sqlite"

    def __init__(self, path: Path, opts: SqliteOptions) -> None:
        self.path, self.opts = path, opts
        self.capabilities = Capabilities(
            list=True, persistent=True, max_object_size=opts.max_object_size
        )
        self._writer = _Threads(path, opts, 1, "kvgate-sqlite-write")
        self._readers = _Threads(path, opts, opts.readers, "kvgate-sqlite-read")
        self._ready = False
        self._ready_lock = asyncio.Lock()
        self._used = 0
        self._closed = False

    @classmethod
    def from_url(cls, url: str, **options: Any) -> SqliteConnector:
        return cls(parse_url(url), parse_options(url, options))

    def __repr__(self) -> str:
        return f"SqliteConnector({str(self.path)!r})"

    async def _open(self) -> None:
        """Create or check the schema once, in the writer thread, before any other call."""
        if self._closed:
            raise Unavailable(f"sqlite: {str(self.path)!r} is closed")
        if self._ready:
            return
        async with self._ready_lock:
            if not self._ready:

                def init(conn: sqlite3.Connection) -> int:
                    database.initialize(conn, self.path)
                    return database.used_bytes(conn)

                self._used = await self._writer.run(init)
                self._ready = True

    async def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        await self._open()
        return await self._readers.run(fn)

    async def _write(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        await self._open()
        return await self._writer.run(fn)

    async def put(self, key: str, data: BufferParts) -> None:
        parts = as_parts(data)
        size, capacity = sum(p.nbytes for p in parts), self.opts.capacity
        if size > self.opts.max_object_size:
            raise CapacityError(
                f"sqlite: {size} bytes is over max_object_size {self.opts.max_object_size}"
            )
        self._used = await self._write(lambda c: database.put(c, key, parts, capacity))

    async def get(self, key: str) -> Buffer | None:
        limit, chunk = read_limit(), self.opts.chunk_size
        return await self._read(lambda c: database.get(c, key, limit, None, chunk))

    async def get_into(self, key: str, alloc: Allocator) -> memoryview | None:
        limit, chunk = read_limit(), self.opts.chunk_size
        got = await self._read(lambda c: database.get(c, key, limit, alloc, chunk))
        return None if got is None else memoryview(got)

    async def exists(self, key: str) -> bool:
        return await self._read(lambda c: database.exists(c, key))

    async def delete(self, key: str) -> bool:
        found, self._used = await self._write(lambda c: database.delete(c, key))
        return found

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        after: bytes | None = None
        while True:
            page = await self._read(
                lambda c, after=after: database.list_page(c, prefix, after)  # type: ignore[misc]
            )
            for key, size in page:
                yield ObjectInfo(key, size)
            if len(page) < database.LIST_PAGE:
                return
            after = database.encode_key(page[-1][0])

    async def ping(self) -> bool:
        await self._read(lambda c: c.execute("SELECT 1").fetchone())
        return True

    def usage(self) -> tuple[int, int | None]:
        return (self._used, self.opts.capacity)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(self._writer.shutdown)
        await asyncio.to_thread(self._readers.shutdown)

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
        """(put GB/s, get GB/s) of plain sqlite3 the obvious way: one connection (WAL) in one
        thread, ``INSERT OR REPLACE`` of the value and ``SELECT`` of it, one per object, in a
        table of its own in the same file (dropped afterwards). Put i stores the bench's
        ``payloads[i % len(payloads)]``, the objects the Store puts."""
        path, opts = parse_url(url), parse_options(url, options)
        table = f"baseline_{uuid.uuid4().hex[:12]}"
        objects = baseline_objects(size, payloads)
        pool = ThreadPoolExecutor(1, thread_name_prefix="kvgate-sqlite-baseline")

        def connect() -> sqlite3.Connection:
            # The same journal and sync settings as the connector's, so that the two differ
            # only in how they move the bytes.
            conn = sqlite3.connect(path, timeout=opts.busy_timeout, check_same_thread=False)
            if conn.execute("SELECT count(*) FROM sqlite_schema").fetchone()[0] == 0:
                database.set_file_format(conn)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute(f"PRAGMA synchronous={opts.synchronous}")
            return conn

        conn = await asyncio.get_running_loop().run_in_executor(pool, connect)

        async def call(fn: Callable[[], T]) -> T:
            return await asyncio.get_running_loop().run_in_executor(pool, fn)

        def put_one(i: int) -> None:
            row = (i, objects[i % len(objects)])
            with conn:
                conn.execute(f"INSERT OR REPLACE INTO {table} VALUES (?, ?)", row)  # noqa: S608

        def get_one(i: int) -> int | None:
            row = conn.execute(f"SELECT v FROM {table} WHERE k = ?", (i,)).fetchone()  # noqa: S608
            return None if row is None else len(row[0])

        try:
            create = f"CREATE TABLE {table} (k INTEGER PRIMARY KEY, v BLOB)"
            await call(lambda: conn.execute(create))
            return await timed_put_get(
                lambda i: call(lambda: put_one(i)),
                lambda i: call(lambda: get_one(i)),
                size=size,
                count=count,
                concurrency=concurrency,
            )
        finally:
            await call(lambda: conn.execute(f"DROP TABLE IF EXISTS {table}"))
            await call(conn.close)
            pool.shutdown(wait=True)
