"""Frames: round trips, and any mangled frame is rejected as corrupt (never a wrong object)."""

from __future__ import annotations

import contextlib
import struct

import msgspec
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.errors import CorruptObject
from gateway.frame import ALIGN, decode_frame, encode_header, key_digest, parse_header


def make_frame(payload: bytes, **kw: object) -> bytes:
    head, _ = encode_header(
        codec="raw",
        kind="bytes",
        dtype="uint8",
        shape=[len(payload)],
        raw_len=len(payload),
        payload=payload,
        **kw,  # type: ignore[arg-type]
    )
    return head + payload


def test_round_trip_and_alignment() -> None:
    payload = bytes(range(256)) * 10
    frame = make_frame(payload, ttl=5.0, params={"level": 3, "tables": [1, 2.5, "x"]})
    header, body = decode_frame(frame)
    assert bytes(body) == payload
    assert (len(frame) - len(payload)) % ALIGN == 0
    assert header.ttl == 5.0
    assert header.params["level"] == 3
    assert not header.expired()
    assert header.expired(now=header.created_at + 6)


def test_scatter_payload_checksum_matches_joined() -> None:
    parts = [b"abc", bytearray(b"def"), memoryview(b"ghij")]
    head, header = encode_header(
        codec="raw", kind="bytes", dtype="uint8", shape=[10], raw_len=10, payload=parts
    )
    assert header.payload_len == 10
    _, body = decode_frame(head + b"abcdefghij")
    assert bytes(body) == b"abcdefghij"


def test_empty_payload() -> None:
    header, body = decode_frame(make_frame(b""))
    assert body.nbytes == 0
    assert header.raw_len == 0


@pytest.mark.parametrize("cut", [0, 3, 15, 16, 40, -1])
def test_truncated(cut: int) -> None:
    frame = make_frame(b"x" * 100)
    with pytest.raises(CorruptObject):
        decode_frame(frame[:cut])


def test_trailing_bytes() -> None:
    with pytest.raises(CorruptObject):
        decode_frame(make_frame(b"x" * 100) + b"\0")


def test_header_alone_parses() -> None:
    frame = make_frame(b"y" * 1000)
    header, offset = parse_header(frame[: ALIGN * 4])
    assert header.payload_len == 1000
    assert offset == len(frame) - 1000


FRAME = make_frame(bytes(range(200)), params={"a": 1})


@settings(max_examples=400)
@given(st.data())
def test_any_single_byte_change_is_rejected(data: st.DataObject) -> None:
    pos = data.draw(st.integers(0, len(FRAME) - 1))
    delta = data.draw(st.integers(1, 255))
    mangled = bytearray(FRAME)
    mangled[pos] = (mangled[pos] + delta) % 256
    with pytest.raises(CorruptObject):
        decode_frame(bytes(mangled))


@settings(max_examples=300)
@given(st.binary(max_size=600), st.integers(0, len(FRAME)), st.integers(0, 64))
def test_any_splice_is_rejected_or_identical(junk: bytes, pos: int, drop: int) -> None:
    """Inserting/deleting bytes anywhere: corrupt, unless the result is the very same frame."""
    mangled = FRAME[:pos] + junk + FRAME[pos + drop :]
    if mangled == FRAME:
        return
    with pytest.raises(CorruptObject):
        decode_frame(mangled)


@settings(max_examples=300)
@given(st.binary(max_size=2048))
def test_arbitrary_bytes_never_crash(blob: bytes) -> None:
    with contextlib.suppress(CorruptObject):
        decode_frame(blob)


# -- binding to keys --------------------------------------------------------------------------


def test_a_frame_is_bound_to_its_key() -> None:
    frame = make_frame(b"payload", key="model@1@0@1a@half")
    header, body = decode_frame(frame, key="model@1@0@1a@half")
    assert bytes(body) == b"payload"
    assert header.key_hash == key_digest("model@1@0@1a@half")
    for other in ("model@1@0@1b@half", "", "model@1@0@1a@half "):
        with pytest.raises(CorruptObject, match="another key"):
            decode_frame(frame, key=other)
    decode_frame(frame)  # a reader that does not know the key checks the rest


def test_keys_with_lone_surrogates_bind_too() -> None:
    frame = make_frame(b"x", key="odd-\udc80")
    decode_frame(frame, key="odd-\udc80")
    with pytest.raises(CorruptObject):
        decode_frame(frame, key="odd-\udc81")


def _version_1_frame(payload: bytes) -> bytes:
    """A frame as kvgate wrote it before keys were bound: version 1, no key_hash field."""
    fields = {
        "codec": "raw",
        "kind": "bytes",
        "dtype": "uint8",
        "shape": [len(payload)],
        "raw_len": len(payload),
        "payload_len": len(payload),
        "checksum": xxhash.xxh3_64_intdigest(payload),
        "fmt": 0,
        "params": {},
        "created_at": 1.0,
        "ttl": None,
    }
    body = msgspec.msgpack.encode(fields)
    start = struct.pack("<4sBBHI", b"KVGF", 1, 0, 0, len(body))
    head = start + struct.pack("<I", xxhash.xxh32_intdigest(start + body)) + body
    return head + bytes(-len(head) % ALIGN) + payload


def test_version_1_frames_are_still_read_unbound() -> None:
    frame = _version_1_frame(b"written by kvgate 0.1")
    header, body = decode_frame(frame, key="any key")
    assert bytes(body) == b"written by kvgate 0.1"
    assert header.key_hash is None


def test_a_version_1_frame_claiming_a_key_is_corrupt() -> None:
    bound = make_frame(b"abc", key="k")
    header_len = struct.unpack_from("<I", bound, 8)[0]
    start = struct.pack("<4sBBHI", b"KVGF", 1, 0, 0, header_len)
    body = bound[16 : 16 + header_len]
    forged = start + struct.pack("<I", xxhash.xxh32_intdigest(start + body)) + bound[16:]
    with pytest.raises(CorruptObject, match="version 1"):
        decode_frame(forged, key="k")
