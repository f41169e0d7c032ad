"""Frames: round trips, and any mangled frame is rejected as corrupt (never a wrong object)."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.errors import CorruptObject
from gateway.frame import ALIGN, decode_frame, encode_header, parse_header


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
