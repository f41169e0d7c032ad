"""The blocking half: one SQLite file, its schema, and each operation as one transaction.

Everything here runs in the connector's worker threads, never on the event loop. Each thread
has its own connection in autocommit mode; every operation opens its own transaction, so:

- a put is ``BEGIN IMMEDIATE``, an upsert of a ``zeroblob`` of the object's size, the bytes
  written into it through incremental blob I/O, the usage counter updated, ``COMMIT``. Until
  the commit, readers (WAL snapshots) see the old row; after it, the new one whole;
- a get is ``BEGIN``, the row's id and length, the blob read, ``COMMIT``: one snapshot, so a
  row replaced meanwhile is never read half old, half new.

Keys are stored as their UTF-8 bytes in a BLOB column: any key, no escaping, no collisions.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from gateway.errors import (
    CapacityError,
    ConfigError,
    GatewayError,
    OverReadLimit,
    Timeout,
    Unavailable,
)
from kvgate_sqlite.options import SqliteOptions

APPLICATION_ID = 0x6B766731  # "kvg1": marks a file as this plugin's, in SQLite's header
SCHEMA = (
    "CREATE TABLE IF NOT EXISTS objects ("
    " id INTEGER PRIMARY KEY, key BLOB NOT NULL UNIQUE, data BLOB NOT NULL)",
    # The bytes the objects hold, kept in the same transactions as the rows (one process or
    # several on one file agree on it without summing the table).
    "CREATE TABLE IF NOT EXISTS usage (id INTEGER PRIMARY KEY CHECK (id = 0), used INTEGER)",
    "INSERT OR IGNORE INTO usage VALUES (0, 0)",
)
LIST_PAGE = 1000
PAGE_SIZE = 65536


def encode_key(key: str) -> bytes:
    return key.encode("utf-8", "surrogatepass")


def decode_key(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogatepass")


def mapped(exc: sqlite3.Error, what: str) -> GatewayError:
    """The kvgate error kind of a SQLite failure (its result code, not its message)."""
    name = getattr(exc, "sqlite_errorname", "") or ""
    text = f"sqlite: {what}: {exc}"
    if name.startswith(("SQLITE_FULL", "SQLITE_TOOBIG")):
        return CapacityError(text)
    if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")):
        return Timeout(text)
    if name.startswith(("SQLITE_CORRUPT", "SQLITE_NOTADB")):
        # The file's structure is damaged (or it was replaced by something else), not one
        # object: the whole tier is out, and no key is deleted as if its object were bad.
        return Unavailable(f"{text} (the database file is damaged or not a database)")
    return Unavailable(text)


@contextmanager
def errors_mapped(what: str) -> Iterator[None]:
    try:
        yield
    except sqlite3.Error as exc:
        raise mapped(exc, what) from exc


def open_connection(path: Path, opts: SqliteOptions) -> sqlite3.Connection:
    """A connection in autocommit mode (transactions are explicit) that may be closed from
    another thread (the connector closes every thread's connection at once)."""
    with errors_mapped(f"open {str(path)!r}"):
        conn = sqlite3.connect(
            path, timeout=opts.busy_timeout, isolation_level=None, check_same_thread=False
        )
        conn.execute(f"PRAGMA synchronous={opts.synchronous}")
        return conn


def initialize(conn: sqlite3.Connection, path: Path) -> None:
    """Make the file a tier (WAL, schema), or check that it is one; refuse anything else."""
    try:
        app_id = conn.execute("PRAGMA application_id").fetchone()[0]
        tables = conn.execute("SELECT count(*) FROM sqlite_schema").fetchone()[0]
    except sqlite3.DatabaseError as exc:
        raise ConfigError(f"sqlite: {str(path)!r} is not a SQLite database ({exc})") from None
    if app_id != APPLICATION_ID and (app_id != 0 or tables != 0):
        raise ConfigError(
            f"sqlite: {str(path)!r} is a database of something else; refusing to use it"
        )
    with errors_mapped("initialize"):
        if tables == 0:
            set_file_format(conn)
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise ConfigError(f"sqlite: {str(path)!r} cannot use WAL mode (got {mode!r})")
        # After a checkpoint, a WAL that a large object grew is cut back to this size.
        conn.execute(f"PRAGMA journal_size_limit={64 << 20}")
        conn.execute("BEGIN IMMEDIATE")
        try:
            for statement in SCHEMA:
                conn.execute(statement)
            conn.execute(f"PRAGMA application_id={APPLICATION_ID}")
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:  # SQLite may have rolled back already (SQLITE_FULL)
                conn.execute("ROLLBACK")
            raise


def set_file_format(conn: sqlite3.Connection) -> None:
    """Large pages for a new file (before WAL mode fixes the page size): an object is a chain
    of overflow pages that every write, read and delete walks, so 64 KiB pages make 16 times
    fewer of them than the default 4 KiB."""
    conn.execute(f"PRAGMA page_size={PAGE_SIZE}")
    conn.execute("VACUUM")  # applies the page size to a file that exists but holds nothing


def used_bytes(conn: sqlite3.Connection) -> int:
    with errors_mapped("usage"):
        return int(conn.execute("SELECT used FROM usage").fetchone()[0])


def put(
    conn: sqlite3.Connection,
    key: str,
    parts: Sequence[memoryview],
    capacity: int | None,
) -> int:
    """Store ``parts`` (concatenated) under ``key`` atomically; returns the bytes now used."""
    size = sum(p.nbytes for p in parts)
    raw = encode_key(key)
    with errors_mapped("put"):
        conn.execute("BEGIN IMMEDIATE")
        try:
            row = conn.execute("SELECT length(data) FROM objects WHERE key = ?", (raw,))
            old = (row.fetchone() or (0,))[0]
            used = int(conn.execute("SELECT used FROM usage").fetchone()[0]) - old + size
            if capacity is not None and used > capacity:
                raise CapacityError(
                    f"sqlite: {size} bytes do not fit: the tier holds {used - size} "
                    f"of {capacity} bytes"
                )
            rowid = conn.execute(
                "INSERT INTO objects (key, data) VALUES (?, zeroblob(?)) "
                "ON CONFLICT (key) DO UPDATE SET data = excluded.data RETURNING id",
                (raw, size),
            ).fetchone()[0]
            if size:
                with conn.blobopen("objects", "data", rowid) as blob:
                    for part in parts:
                        if part.nbytes:
                            blob.write(part)
            conn.execute("UPDATE usage SET used = ?", (used,))
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:  # SQLite may have rolled back already (SQLITE_FULL)
                conn.execute("ROLLBACK")
            raise
    return used


def get(
    conn: sqlite3.Connection,
    key: str,
    limit: int | None,
    alloc: Callable[[int], memoryview | None] | None,
    chunk: int,
) -> bytes | memoryview | None:
    """The object under ``key`` (in ``alloc``'s buffer when it gives one), or None."""
    with errors_mapped("get"):
        conn.execute("BEGIN")
        try:
            row = conn.execute(
                "SELECT id, length(data) FROM objects WHERE key = ?", (encode_key(key),)
            ).fetchone()
            if row is None:
                return None
            rowid, size = row
            if limit is not None and size > limit:
                raise OverReadLimit(
                    f"sqlite: {key!r} holds {size} bytes, over this reader's limit of {limit}"
                )
            dst = alloc(size) if alloc is not None else None
            if size == 0:
                return dst if dst is not None else b""
            with conn.blobopen("objects", "data", rowid, readonly=True) as blob:
                if dst is None:
                    return blob.read()
                for start in range(0, size, chunk):
                    piece = blob.read(chunk)
                    dst[start : start + len(piece)] = piece
                return dst
        finally:
            conn.execute("COMMIT")


def exists(conn: sqlite3.Connection, key: str) -> bool:
    with errors_mapped("exists"):
        row = conn.execute("SELECT 1 FROM objects WHERE key = ?", (encode_key(key),))
        return row.fetchone() is not None


def delete(conn: sqlite3.Connection, key: str) -> tuple[bool, int]:
    """Remove ``key``; (whether it was there, the bytes now used)."""
    with errors_mapped("delete"):
        conn.execute("BEGIN IMMEDIATE")
        try:
            row = conn.execute(
                "DELETE FROM objects WHERE key = ? RETURNING length(data)", (encode_key(key),)
            ).fetchone()
            if row is not None:
                conn.execute("UPDATE usage SET used = used - ?", (row[0],))
            used = int(conn.execute("SELECT used FROM usage").fetchone()[0])
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:  # SQLite may have rolled back already (SQLITE_FULL)
                conn.execute("ROLLBACK")
            raise
    return row is not None, used


def list_page(conn: sqlite3.Connection, prefix: str, after: bytes | None) -> list[tuple[str, int]]:
    """Up to LIST_PAGE (key, size) pairs under ``prefix``, in key order, after ``after``."""
    raw = encode_key(prefix)
    with errors_mapped("list"):
        if after is None:
            rows = conn.execute(
                "SELECT key, length(data) FROM objects WHERE key >= ? ORDER BY key LIMIT ?",
                (raw, LIST_PAGE),
            ).fetchall()
        else:
            rows = conn.execute(
                "SELECT key, length(data) FROM objects WHERE key > ? ORDER BY key LIMIT ?",
                (after, LIST_PAGE),
            ).fetchall()
    out = []
    for key, size in rows:
        if not bytes(key).startswith(raw):
            break
        out.append((decode_key(bytes(key)), int(size)))
    return out
