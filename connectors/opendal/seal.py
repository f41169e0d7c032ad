"""The ``sealed`` write mode's trailer: how a reader tells a whole object from a torn one.

Services whose writes are not atomic and that cannot rename (FTP in OpenDAL 0.47) overwrite
an object in place, so a reader racing a writer can read a prefix of the new bytes, or old
bytes cut short. Each object is stored as its bytes plus a trailer: a magic, the length and
an xxh3-64 of the bytes. A read whose trailer does not match is torn (or not ours): the
connector reads again, and a key that never reads whole is a ``CorruptObject``.
"""

from __future__ import annotations

import struct

import xxhash

from gateway.types import Buffer

MAGIC = b"KVGSEAL1"
TRAILER = struct.Struct("<8sQQ")
SIZE = TRAILER.size


def trailer(parts: list[memoryview]) -> bytes:
    h = xxhash.xxh3_64()
    for part in parts:
        h.update(part)
    return TRAILER.pack(MAGIC, sum(p.nbytes for p in parts), h.intdigest())


def unsealed(data: Buffer) -> memoryview | None:
    """The object's bytes if ``data`` is whole (its trailer matches), else None."""
    view = memoryview(data).cast("B")
    if view.nbytes < SIZE:
        return None
    magic, length, digest = TRAILER.unpack(view[-SIZE:])
    body = view[:-SIZE]
    if magic != MAGIC or length != body.nbytes or xxhash.xxh3_64_intdigest(body) != digest:
        return None
    return body
