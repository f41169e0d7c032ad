"""Frames with valid checksums but hostile headers are counted misses, never wrong objects."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

import pytest
import xxhash
import zstandard

from connectors.memory import MemoryConnector
from gateway import CapacityError, Store
from gateway.connector import Allocator
from gateway.errors import CorruptRemoved
from gateway.frame import encode_header
from gateway.layers import Layer
from gateway.types import Buffer


def plant(
    conn: MemoryConnector,
    key: str,
    codec: str,
    kind: str,
    dtype: str,
    shape: list[int],
    raw_len: int,
    payload: bytes,
) -> None:
    head, _ = encode_header(
        codec=codec,
        kind=kind,
        dtype=dtype,
        shape=shape,  # type: ignore[arg-type]
        raw_len=raw_len,
        payload=payload,
    )
    conn.objects[key] = head + payload


@pytest.mark.parametrize(
    ("kind", "dtype", "shape", "payload"),
    [
        ("tensor", "float", [2], b"\0" * 16),  # a numpy name, not ours
        ("ndarray", "O", [2], b"\x01" * 16),  # object arrays
        ("ndarray", "uint8", [1] * 70, b"\0"),  # too many dimensions
        ("ndarray", "U2", [2], "abcd".encode("utf-32-le")),  # strings
        ("ndarray", "M8[s]", [1], b"\0" * 8),  # datetimes
        ("bytes", "float32", [4], b"\0" * 16),  # bytes are 1-D uint8
        ("pickle", "uint8", [3], b"abc"),  # unknown kind
        ("tensor", "float32", [5], b"\0" * 16),  # shape does not match the length
        ("tensor", "float16", [2**63, 0], b""),  # empty, but no numpy or torch builds it
        ("ndarray", "uint8", [2**62, 2, 0], b""),
    ],
)
async def test_hostile_metadata_is_a_counted_miss(
    kind: str, dtype: str, shape: list[int], payload: bytes
) -> None:
    conn = MemoryConnector()
    async with Store({"tiers": [{"url": "memory://x"}]}, connectors={0: conn}) as store:
        plant(conn, "k", "raw", kind, dtype, shape, len(payload), payload)
        assert await store.get("k") is None
        assert store.stats()["memory"].corrupt == 1


@pytest.mark.parametrize(
    "fields", [{"fmt": 99}, {"ttl": float("nan")}, {"ttl": -1.0}, {"fmt": 2**40}], ids=str
)
async def test_a_format_or_ttl_no_put_accepts_is_a_counted_miss(fields: dict[str, Any]) -> None:
    conn = MemoryConnector()
    async with Store({"tiers": [{"url": "memory://x"}]}, connectors={0: conn}) as store:
        head, _ = encode_header(
            codec="raw", kind="bytes", dtype="uint8", shape=[3], raw_len=3, payload=b"abc", **fields
        )
        conn.objects["k"] = head + b"abc"
        assert await store.get("k") is None
        assert store.stats()["memory"].corrupt == 1


async def test_raw_length_beyond_the_payload_never_reads_a_neighbour(tmp_path: Path) -> None:
    cfg = {"tiers": [{"url": "memory://", "capacity": 1 << 20}, {"url": f"file://{tmp_path}"}]}
    async with Store(cfg) as store:
        await store.put("pad", b"p" * 200)
        await store.put("secret", b"TOP-SECRET " * 20)
        await store.flush()
        assert store.l1 is not None
        store.l1.remove("pad")
        payload = b"hello, world!!!!"
        head, _ = encode_header(
            codec="raw", kind="bytes", dtype="uint8", shape=[400], raw_len=400, payload=payload
        )
        await store.tiers[0].connector.put("evil", [head, payload])
        assert await store.get("evil") is None
        assert store.stats()["file"].corrupt == 1


async def test_decompression_bomb_is_refused() -> None:
    claimed = 3 << 30
    cobj = zstandard.ZstdCompressor(level=1).compressobj(size=claimed)
    chunk = bytes(64 << 20)
    payload = b"".join(cobj.compress(chunk) for _ in range(claimed // len(chunk))) + cobj.flush()
    conn = MemoryConnector()
    plant(conn, "k", "zstd", "bytes", "uint8", [claimed], claimed, payload)
    cfg = {"tiers": [{"url": f"memory://{uuid.uuid4().hex}", "codec": "zstd"}]}
    async with Store(cfg, connectors={0: conn}) as store:
        assert await store.get("k") is None
        assert next(iter(store.stats().values())).corrupt == 1


async def test_oversized_put_is_refused_clearly() -> None:
    cfg = {"tiers": [{"url": "memory://"}], "max_object_size": "1MiB"}
    async with Store(cfg) as store:
        with pytest.raises(CapacityError, match="max_object_size"):
            await store.put("k", b"x" * (2 << 20))
        assert await store.get("k") is None


class _AlreadyRemoved(Layer):
    """A backend that finds the key's bytes broken and takes them away itself (as the disk
    tier quarantines a broken file), recording the deletes it is asked for."""

    def __init__(self, inner: MemoryConnector) -> None:
        super().__init__(inner)
        self.deletes: list[str] = []

    async def get_into(self, key: str, alloc: Allocator) -> memoryview | None:
        raise CorruptRemoved(f"{key}: not a whole record (quarantined)")

    async def get(self, key: str) -> Buffer | None:
        raise CorruptRemoved(f"{key}: not a whole record (quarantined)")

    async def delete(self, key: str) -> bool:
        self.deletes.append(key)
        return await super().delete(key)


async def test_corrupt_bytes_the_backend_removed_are_counted_and_not_deleted_again() -> None:
    backend = _AlreadyRemoved(MemoryConnector.from_url(f"memory://{uuid.uuid4().hex}"))
    config = {"tiers": [{"url": "memory://"}], "staging": 1 << 20}
    async with Store(config, connectors={0: backend}) as store:
        await store.put("k", b"v" * 100)
        await store.flush()
        assert await store.get("k") is None
        assert store.stats()["memory"].corrupt == 1
        assert backend.deletes == []  # a delete now could remove a newer object


def _shared_config(url: str, max_object_size: int | None = None) -> dict[str, Any]:
    config: dict[str, Any] = {"tiers": [{"url": url}], "staging": 4 << 20}
    if max_object_size is not None:
        config["max_object_size"] = max_object_size
    return config


async def test_a_reader_with_a_smaller_limit_leaves_larger_objects_to_the_others() -> None:
    url = f"memory://{uuid.uuid4().hex}"  # one namespace: what every store here sees
    async with Store(_shared_config(url), connectors={0: MemoryConnector.from_url(url)}) as writer:
        await writer.put("big", b"b" * (2 << 20), durable=True)
    small_config = _shared_config(url, 1 << 20)
    async with Store(small_config, connectors={0: MemoryConnector.from_url(url)}) as small:
        assert await small.get("big") is None  # over what it takes: a miss for it
        assert small.stats()["memory"].corrupt == 1
    async with Store(_shared_config(url), connectors={0: MemoryConnector.from_url(url)}) as other:
        assert await other.get("big") == b"b" * (2 << 20)  # still there for the others


async def test_bytes_kvgate_did_not_write_are_a_miss_left_in_place() -> None:
    url = f"memory://{uuid.uuid4().hex}"
    shared = MemoryConnector.from_url(url)
    await shared.put("theirs", b"an LMCache engine's chunk, not a kvgate frame")
    await shared.put("empty", b"")  # LMCache's tombstone
    async with Store(_shared_config(url), connectors={0: MemoryConnector.from_url(url)}) as store:
        assert await store.get("theirs") is None
        assert await store.get("empty") is None
        assert store.stats()["memory"].corrupt == 2
    after = MemoryConnector.from_url(url)
    assert await after.get("theirs") == b"an LMCache engine's chunk, not a kvgate frame"
    assert await after.exists("empty")


async def test_a_key_left_in_place_is_logged_once_not_on_every_read(
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = f"memory://{uuid.uuid4().hex}"
    shared = MemoryConnector.from_url(url)
    await shared.put("theirs", b"not a kvgate frame")
    async with Store(_shared_config(url), connectors={0: MemoryConnector.from_url(url)}) as store:
        with caplog.at_level(logging.WARNING, logger="kvgate.tiers"):
            for _ in range(5):
                assert await store.get("theirs") is None
        assert store.stats()["memory"].corrupt == 5
    lines = [r for r in caplog.records if "left in place" in r.message]
    assert len(lines) == 1


async def test_a_key_left_in_place_is_not_looked_up_as_stored_until_this_store_writes_it() -> None:
    # vLLM's scheduler plans loads from lookups: a prefix counted as stored that every get
    # misses would be recomputed on every request and never saved again.
    url = f"memory://{uuid.uuid4().hex}"
    shared = MemoryConnector.from_url(url)
    await shared.put("theirs", b"not a kvgate frame")
    async with Store(_shared_config(url), connectors={0: MemoryConnector.from_url(url)}) as store:
        await store.put("first", b"f" * 100, durable=True)
        assert await store.lookup(["first", "theirs"]) == 2  # not read yet: the tier has it
        assert await store.get("theirs") is None
        assert await store.lookup(["first", "theirs"]) == 1
        assert await store.contains_many(["first", "theirs"]) == [True, False]
        await store.put("theirs", b"ours", durable=True)
        assert await store.lookup(["first", "theirs"]) == 2
        assert await store.get("theirs") == b"ours"


def _with_version(frame: bytes, version: int) -> bytes:
    """``frame`` relabelled as ``version``, its header checksum made right again."""
    out = bytearray(frame)
    out[4] = version
    header_len = int.from_bytes(out[8:12], "little")
    body = bytes(out[16 : 16 + header_len])
    out[12:16] = xxhash.xxh32_intdigest(bytes(out[:12]) + body).to_bytes(4, "little")
    return bytes(out)


async def test_a_frame_of_a_newer_version_is_a_miss_left_for_the_newer_readers() -> None:
    url = f"memory://{uuid.uuid4().hex}"
    async with Store(_shared_config(url), connectors={0: MemoryConnector.from_url(url)}) as writer:
        await writer.put("newer", b"n" * 100, durable=True)
        await writer.put("zero", b"z" * 100, durable=True)
        await writer.put("flipped", b"f" * 100, durable=True)
    shared = MemoryConnector.from_url(url)
    shared.objects["newer"] = _with_version(shared.objects["newer"], 3)
    shared.objects["zero"] = _with_version(shared.objects["zero"], 0)
    flipped = bytearray(shared.objects["flipped"])
    flipped[4] = 3  # a bit flip in the version byte: the header checksum no longer matches
    shared.objects["flipped"] = bytes(flipped)
    async with Store(_shared_config(url), connectors={0: MemoryConnector.from_url(url)}) as store:
        for key in ("newer", "zero", "flipped"):
            assert await store.get(key) is None
        assert store.stats()["memory"].corrupt == 3
    assert await shared.exists("newer")  # perhaps a newer kvgate's, in a rolling upgrade
    assert not await shared.exists("zero")  # no kvgate writes version 0: corrupt, removed
    assert not await shared.exists("flipped")
