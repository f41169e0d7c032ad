"""StreamingChecksum: the digest of a frame's payload, fed by ranges in any order and from any
thread, equals the payload's xxh3; anything short of every byte gives no digest."""

from __future__ import annotations

import itertools
import random
import threading
from pathlib import Path

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.errors import CorruptObject
from gateway.frame import decode_frame, encode_header
from gateway.frame_check import StreamingChecksum
from gateway.store import Store


def frame_of(payload: bytes) -> bytearray:
    head, _ = encode_header(
        codec="raw",
        kind="bytes",
        dtype="uint8",
        shape=[len(payload)],
        raw_len=len(payload),
        payload=payload,
    )
    return bytearray(head + payload)


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
    tmp_path: Path,
) -> None:
    """A 24 MiB object takes the two-thread hashed read of the file tier; a flipped byte in
    the file is still a counted miss."""
    obj = np.random.default_rng(1).integers(0, 256, 24 << 20, dtype=np.uint8)
    cfg = {"tiers": [{"url": f"file://{tmp_path}"}], "staging": 64 << 20}
    async with Store(cfg) as store:
        await store.put("k", obj)
        await store.flush()
        got = await store.get("k")
        assert got is not None
        assert np.array_equal(got, obj)
        del got
        path = next(p for p in (tmp_path / "objects").rglob("*.kvo"))
        blob = bytearray(path.read_bytes())
        blob[-12345] ^= 0x40
        path.write_bytes(blob)
        assert await store.get("k") is None
        assert store.stats()["file"].corrupt == 1
