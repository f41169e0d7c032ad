"""StreamingChecksum: the digest of a frame's payload, fed by ranges in any order and from any
thread, equals the payload's xxh3; anything short of every byte gives no digest."""

from __future__ import annotations

import itertools
import os
import random
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from test_frame import make_frame  # tests/ is on sys.path: the frame every test builds

from connectors.fs.connector import FileConnector
from gateway import frame, tiers
from gateway.errors import CorruptObject
from gateway.frame import decode_frame
from gateway.frame_check import StreamingChecksum
from gateway.memory import BufferPool, Slab
from gateway.objects import to_object_data
from gateway.registry import load_codec
from gateway.store import Store
from gateway.tiers import ConnectorTier
from gateway.types import TierStats


def frame_of(payload: bytes) -> bytearray:
    return bytearray(make_frame(payload))


def cut_points(n: int, rng: random.Random, pieces: int) -> list[tuple[int, int]]:
    cuts = sorted({0, n, *(rng.randrange(n + 1) for _ in range(pieces))})
    return list(itertools.pairwise(cuts))


@settings(max_examples=200, deadline=None)
@given(
    payload=st.binary(max_size=3000),
    pieces=st.integers(0, 12),
    seed=st.integers(0, 2**32 - 1),
)
def test_any_order_of_ranges_gives_the_payload_digest(
    payload: bytes, pieces: int, seed: int
) -> None:
    frame = frame_of(payload)
    rng = random.Random(seed)
    ranges = cut_points(len(frame), rng, pieces)
    rng.shuffle(ranges)
    check = StreamingChecksum(memoryview(frame))
    for start, stop in ranges:
        check.filled(start, stop)
    assert check.digest() == xxhash.xxh3_64_intdigest(payload)
    _, body = decode_frame(frame, digest=check.digest())
    assert bytes(body) == payload


@settings(max_examples=100, deadline=None)
@given(payload=st.binary(min_size=1, max_size=2000), seed=st.integers(0, 2**32 - 1))
def test_a_missing_range_gives_no_digest(payload: bytes, seed: int) -> None:
    frame = frame_of(payload)
    rng = random.Random(seed)
    ranges = cut_points(len(frame), rng, 6)
    ranges.pop(rng.randrange(len(ranges)))
    check = StreamingChecksum(memoryview(frame))
    for start, stop in ranges:
        check.filled(start, stop)
    assert check.digest() is None


def test_two_threads_filling_halves() -> None:
    payload = np.random.default_rng(0).integers(0, 256, 5 << 20, dtype=np.uint8).tobytes()
    frame = frame_of(payload)
    view = memoryview(frame)
    check = StreamingChecksum(view)
    cut = len(frame) * 2 // 5

    def fill(start: int, stop: int) -> None:
        for a in range(start, stop, 64 << 10):
            check.filled(a, min(stop, a + (64 << 10)))

    threads = [threading.Thread(target=fill, args=r) for r in ((0, cut), (cut, len(frame)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert check.digest() == xxhash.xxh3_64_intdigest(payload)


def test_mangled_payload_is_caught_with_a_streamed_digest() -> None:
    frame = frame_of(b"x" * 1000)
    frame[-1] ^= 1
    check = StreamingChecksum(memoryview(frame))
    check.filled(0, len(frame))
    with pytest.raises(CorruptObject, match="checksum"):
        decode_frame(frame, digest=check.digest())


def test_mangled_header_length_cannot_send_the_hash_past_the_buffer() -> None:
    frame = frame_of(b"y" * 100)
    frame[8:12] = (0xFFFFFFFF).to_bytes(4, "little")
    check = StreamingChecksum(memoryview(frame))
    check.filled(0, len(frame))
    with pytest.raises(CorruptObject):
        decode_frame(frame, digest=check.digest())


async def test_file_tier_hashes_while_reading_and_still_catches_corruption(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 24 MiB object: put hashes it once (no tier hashes it again), the file tier's get
    hands decode_frame a digest made while reading, and a flipped byte in the file is still
    a counted miss."""
    hashed: list[int] = []
    digests: list[int | None] = []
    real_checksum, real_decode = frame.payload_checksum, tiers.decode_frame

    def counting_checksum(payload: Any) -> int:
        hashed.append(1)
        return real_checksum(payload)

    def spying_decode(blob: Any, **kw: Any) -> Any:
        digests.append(kw.get("digest"))
        return real_decode(blob, **kw)

    monkeypatch.setattr(frame, "payload_checksum", counting_checksum)
    monkeypatch.setattr(tiers, "decode_frame", spying_decode)
    obj = np.random.default_rng(1).integers(0, 256, 24 << 20, dtype=np.uint8)
    cfg = {"tiers": [{"url": f"file://{tmp_path}"}], "staging": 64 << 20}
    async with Store(cfg) as store:
        await store.put("k", obj)
        await store.flush()
        assert hashed == []  # the checksum made while put copied the object was reused
        got = await store.get("k")
        assert got is not None
        assert np.array_equal(got, obj)
        assert digests == [xxhash.xxh3_64_intdigest(obj)]
        del got
        path = next(p for p in (tmp_path / "objects").rglob("*.kvo"))
        blob = bytearray(path.read_bytes())
        blob[-12345] ^= 0x40
        path.write_bytes(blob)
        assert await store.get("k") is None
        assert store.stats()["file"].corrupt == 1


async def test_a_slab_the_connector_did_not_fill_is_never_served(tmp_path: Path) -> None:
    """The connector asked for a slab, then (the file changed size) for another buffer, got
    none and read into its own: the first slab, never filled, must not be taken for the
    object."""
    conn = FileConnector(tmp_path)
    tier = ConnectorTier("file", conn, load_codec("raw"), TierStats("file"))
    small = np.arange(1000, dtype=np.uint16)
    await tier.write("k", to_object_data(small))
    saved = tmp_path / "saved"
    shutil.copy(conn.path_for("k"), saved)
    await tier.write("k", to_object_data(np.full(5000, 7, dtype=np.uint16)))
    os.replace(saved, conn.path_for("k"))  # the index says 10000 bytes, the file holds 2000
    pool = BufferPool(1 << 20)
    calls: list[int] = []

    def alloc(n: int) -> Slab | None:
        calls.append(n)
        if len(calls) > 1:
            return None  # the pool is full by the time the connector asks again
        slab = pool.alloc(n)
        assert slab is not None
        slab.view()[:] = b"\xab" * n  # what an earlier object left there
        return slab

    found = await tier.read("k", alloc, 1 << 30)
    assert found is not None
    assert np.array_equal(np.asarray(found.to_object()), small)
    assert len(calls) >= 2
    await conn.close()
