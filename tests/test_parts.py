"""The part layout shared by the Redis, Valkey and memcached connectors (gateway/parts.py).

The engine itself (commit order, partial sets, superseded parts) is tested against each real
server by its connector's tests; this file checks the pure pieces (slicing and the manifest)
and, on a dict, one interleaving a real server makes rare: an overwrite between a reader's
read of the main key and of its parts.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.errors import CorruptObject
from gateway.parts import (
    MANIFEST_SIZE,
    Manifest,
    StripedObjects,
    parse_head,
    size_of,
    slice_parts,
)


@given(
    sizes=st.lists(st.integers(0, 40), max_size=6),
    part_size=st.integers(1, 17),
)
def test_slices_concatenate_to_the_object(sizes: list[int], part_size: int) -> None:
    bufs = [bytes((i * 7 + j) % 251 for j in range(n)) for i, n in enumerate(sizes)]
    whole = b"".join(bufs)
    slices = slice_parts(bufs, part_size)
    assert b"".join(bytes(s) for s in slices) == whole
    assert all(s.nbytes == part_size for s in slices[:-1])
    assert len(slices) == -(-len(whole) // part_size)


def test_whole_parts_are_views_not_copies() -> None:
    data = bytearray(b"x" * 12)
    slices = slice_parts(memoryview(data), 4)
    data[0] = ord("y")
    assert bytes(slices[0]) == b"yxxx"


def test_manifest_round_trips_and_spans_cover_the_object() -> None:
    m = Manifest(b"g" * 16, total=10, part_size=4, count=3)
    value = m.encode()
    assert len(value) == MANIFEST_SIZE
    assert parse_head(value) == m
    assert m.spans() == [(0, 4), (4, 4), (8, 2)]
    assert size_of(value) == 10


def test_inline_values_report_their_size() -> None:
    assert parse_head(b"\x00abc") is None
    assert size_of(b"\x00abc") == 3
    assert size_of(b"\x00") == 0


@pytest.mark.parametrize(
    "value",
    [
        b"",
        b"\x02junk",
        b"\x01short",
        Manifest(b"g" * 16, 10, 4, 2).encode(),  # count does not match total / part size
        b"\x01" + b"XXXX" + Manifest(b"g" * 16, 10, 4, 3).encode()[5:],  # bad magic
    ],
)
def test_anything_else_is_a_corrupt_object(value: bytes) -> None:
    with pytest.raises(CorruptObject):
        parse_head(value)


class _DictParts:
    """``PartBackend`` on a dict: the primitives, nothing more."""

    def __init__(self) -> None:
        self.values: dict[bytes, bytes] = {}
        self.before_parts: list[Callable[[], Awaitable[None]]] = []

    async def read(self, key: bytes) -> bytes | None:
        return self.values.get(key)

    async def read_parts_into(self, keys: Sequence[bytes], dsts: Sequence[memoryview]) -> bool:
        while self.before_parts:  # what happens between the main key's read and the parts'
            await self.before_parts.pop()()
        for i in range(len(keys)):
            value = self.values.get(keys[i])
            if value is None or len(value) != dsts[i].nbytes:
                return False
            dsts[i][:] = value
        return True

    async def write_parts(self, items: Sequence[tuple[bytes, memoryview]], ttl: float) -> None:
        self.values.update((k, bytes(v)) for k, v in items)

    async def swap(self, key: bytes, value: Sequence[memoryview], ttl: float | None) -> Any:
        old = self.values.get(key)
        self.values[key] = b"".join(bytes(v) for v in value)
        return old

    async def take(self, key: bytes) -> bytes | None:
        return self.values.pop(key, None)

    async def set_ttl(self, keys: Sequence[bytes], ttl: float | None) -> None:
        pass

    async def remove(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self.values.pop(key, None)


async def test_a_read_whose_parts_an_overwrite_deleted_reads_the_newer_object() -> None:
    backend = _DictParts()
    objects = StripedObjects(backend, parts_prefix=b"p:", part_size=4, inline_max=0)
    await objects.put(b"k", b"old object")
    backend.before_parts.append(lambda: objects.put(b"k", b"new object!"))
    got = await objects.get_into(b"k", lambda n: None)
    assert got is not None  # never a miss: k always held an object
    assert bytes(got) == b"new object!"
    # Parts gone without a newer commit (evicted, expired): a miss.
    for key in [k for k in backend.values if k.startswith(b"p:")]:
        del backend.values[key]
    assert await objects.get_into(b"k", lambda n: None) is None
