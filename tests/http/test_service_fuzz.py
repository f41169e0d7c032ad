"""Hypothesis against the HTTP service: hostile object headers, frames and declared lengths.

The property, for every request: a 4xx answer with a JSON error (``{"error", "detail"}``), or a
204 after which the object reads back exactly as described. The store behind the server has no
memory tier, so every object read back comes from the disk tier's frame: what the service
accepts, a lower tier stores and reads back. Declared lengths and chunked bodies go over raw
sockets, where uvicorn's own 400 (plain text, for requests it cannot parse) is allowed too;
never a 5xx and never a hang (the body timeout is short).
"""

from __future__ import annotations

import contextlib
import json
import math
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from servers.uvicorn_thread import serve_in_thread

from gateway.codec import encode_frame
from gateway.frame import MAGIC, VERSION, FrameHeader, parse_header, payload_offset_of
from gateway.http.app import create_app
from gateway.object_meta import ITEMSIZE
from gateway.objects import to_object_data
from gateway.registry import load_codec
from gateway.types import BYTE_KINDS, OBJECT_KINDS

FRAME = "application/vnd.kvgate.frame"
FRAMES = "application/vnd.kvgate.frames"
MAX_BODY = 1 << 20
SETTINGS = settings(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    disk: Path = tmp_path_factory.mktemp("disk")
    app = create_app(
        {"tiers": [{"url": f"file://{disk}"}]},
        max_body=MAX_BODY,
        body_pool=0,
        body_timeout=0.3,
    )
    yield from serve_in_thread(app, log_level="critical")


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=10) as c:
        yield c


def assert_client_error(r: httpx.Response) -> None:
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert set(r.json()) == {"error", "detail"}, r.text


def read_back(client: httpx.Client, key: str) -> httpx.Response:
    assert client.post("/v1/flush").status_code == 204
    r = client.get(f"/v1/objects/{key}")
    assert r.status_code == 200, (key, r.status_code, r.text)
    return r


# -- plain PUTs: the x-kvgate-* headers ------------------------------------------------------

HEADER_TEXT = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=30)
DIM_TEXT = st.one_of(
    st.integers(-3, 70).map(str),
    st.sampled_from([2**31, 2**62, 2**63 - 1, 2**63, 2**64, 10**30]).map(str),
    st.sampled_from(["", " ", "x", "1.5", "1e3", "-0", "0x10", "1_0"]),
)
SHAPE_TEXT = st.one_of(
    st.lists(DIM_TEXT, max_size=36).map(",".join),
    st.lists(st.integers(0, 4).map(str), min_size=30, max_size=70).map(",".join),
    HEADER_TEXT,
)
PLAIN_HEADERS = st.fixed_dictionaries(
    {},
    optional={
        "x-kvgate-kind": st.one_of(st.sampled_from([*OBJECT_KINDS, "pickle", ""]), HEADER_TEXT),
        "x-kvgate-dtype": st.one_of(st.sampled_from([*ITEMSIZE, "float", "O", ""]), HEADER_TEXT),
        "x-kvgate-shape": SHAPE_TEXT,
        "x-kvgate-format": st.one_of(
            st.integers(-2, 12).map(str), st.sampled_from(["2**70", str(2**70), "1.0", "x", ""])
        ),
        "x-kvgate-ttl": st.one_of(
            st.sampled_from(["nan", "inf", "-inf", "-1", "0", "1e308", "1e309", "x", "", "3600"]),
            st.floats(allow_nan=False).map(repr),
        ),
        "content-type": st.sampled_from(
            ["application/octet-stream", "application/octet-stream; x=1", FRAME, "text/plain"]
        ),
    },
)


def expected_plain(headers: dict[str, str], body: bytes) -> dict[str, str]:
    """What a GET must answer in its headers for an accepted plain PUT."""
    dtype = headers.get("x-kvgate-dtype")
    kind = headers.get("x-kvgate-kind") or ("tensor" if dtype else "bytes")
    if kind in BYTE_KINDS:
        return {
            "x-kvgate-kind": "bytes",
            "x-kvgate-dtype": "uint8",
            "x-kvgate-shape": str(len(body)),
        }
    dtype = dtype or "uint8"
    shape = headers.get("x-kvgate-shape")
    if shape is None:
        shape = str(len(body) // ITEMSIZE[dtype])
    else:
        shape = ",".join(str(int(d)) for d in shape.split(",") if d.strip())
    return {"x-kvgate-kind": kind, "x-kvgate-dtype": dtype, "x-kvgate-shape": shape}


@settings(SETTINGS, max_examples=200)
@given(headers=PLAIN_HEADERS, body=st.binary(max_size=96))
def test_plain_puts_are_stored_exactly_or_refused(
    client: httpx.Client, headers: dict[str, str], body: bytes
) -> None:
    headers = {k: v.strip(" ") for k, v in headers.items()}  # HTTP drops the spaces around values
    r = client.put("/v1/objects/plain", content=body, headers=headers)
    event(f"status {r.status_code}")
    if r.status_code != 204:
        assert_client_error(r)
        return
    ttl = headers.get("x-kvgate-ttl")
    if ttl is not None and float(ttl) < 3600:
        return  # may have expired already: nothing to read back
    back = read_back(client, "plain")
    assert back.content == body
    want = expected_plain(headers, body)
    assert {k: back.headers[k] for k in want} == want
    assert back.headers["x-kvgate-format"] == str(int(headers.get("x-kvgate-format", "0")))


# -- frames: valid ones, then fields replaced (re-signed) and bytes mangled --------------------

_encoder = msgspec.msgpack.Encoder()


def signed_head(header: FrameHeader) -> bytes:
    """A frame head for ``header`` with a correct header checksum (see ``gateway.frame``)."""
    body = _encoder.encode(header)
    start = struct.pack("<4sBBHI", MAGIC, VERSION, 0, 0, len(body))
    head = start + struct.pack("<I", xxhash.xxh32_intdigest(start + body)) + body
    return head + bytes(payload_offset_of(len(body)) - len(head))


CODECS = ["raw", "zstd", "lz4", "bytesplit", "fp8"]
U64 = st.integers(0, 2**64 - 1)
HOSTILE_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "codec": st.sampled_from([*CODECS, "nope", ""]),
    "kind": st.sampled_from([*OBJECT_KINDS, "pickle"]),
    "dtype": st.sampled_from([*ITEMSIZE, "float", "O", "M8[s]"]),
    "shape": st.lists(
        st.one_of(st.integers(0, 5), st.sampled_from([2**62, 2**63 - 1, 2**63, 2**64 - 1])),
        max_size=40,
    ),
    "raw_len": st.one_of(st.integers(0, 300), U64),
    "payload_len": st.one_of(st.integers(0, 300), U64),
    "checksum": U64,
    "fmt": st.one_of(st.integers(-2, 12), st.integers(-(2**63), 2**64 - 1)),
    "params": st.dictionaries(
        st.sampled_from(["mode", "bits", "group", "scale", "x"]),
        st.one_of(st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=5)),
        max_size=3,
    ),
    "created_at": st.floats(),
    "ttl": st.one_of(st.none(), st.floats()),
}
OBJECTS = st.one_of(
    st.binary(max_size=200),
    st.builds(
        lambda dtype, n, seed: np.random.default_rng(seed).standard_normal(n).astype(dtype),
        st.sampled_from(["float16", "float32", "int8"]),
        st.integers(0, 64),
        st.integers(0, 2**32),
    ),
)


@st.composite
def frames(draw: st.DrawFn) -> tuple[bytes, bytes | None]:
    """A frame, and the object's bytes when the frame is still the valid one."""
    obj = draw(OBJECTS)
    data = to_object_data(obj, draw(st.integers(0, 8)))
    head, parts, _ = encode_frame(load_codec(draw(st.sampled_from(CODECS))), data)
    payload = b"".join(bytes(p) for p in parts)
    original = bytes(data.host())
    changes = draw(st.dictionaries(st.sampled_from(sorted(HOSTILE_FIELDS)), st.none(), max_size=3))
    if changes:
        header = parse_header(head)[0]
        replaced = {name: draw(HOSTILE_FIELDS[name]) for name in changes}
        try:
            head = signed_head(msgspec.structs.replace(header, **replaced))
        except OverflowError:  # msgpack cannot carry it: no client can send it either
            assume(False)
        original = None  # type: ignore[assignment]
    blob = bytearray(head + payload)
    mangle = draw(st.sampled_from(["none", "flip", "truncate", "append"]))
    if mangle != "none" and blob:
        at = draw(st.integers(0, len(blob) - 1))
        if mangle == "flip":
            blob[at] ^= draw(st.integers(1, 255))
        elif mangle == "truncate":
            del blob[at:]
        else:
            blob += draw(st.binary(min_size=1, max_size=8))
        original = None  # type: ignore[assignment]
    return bytes(blob), original


DIMS = st.one_of(st.integers(0, 3), st.sampled_from([2**31, 2**62, 2**63 - 1, 2**63]))


@st.composite
def described_frames(draw: st.DrawFn) -> tuple[bytes, bytes | None]:
    """A raw frame built from a description whose fields agree with each other (the shape
    holds raw_len bytes, which the payload has), at the edges of what can be stored."""
    dtype = draw(st.sampled_from(sorted(ITEMSIZE)))
    shape = draw(st.lists(DIMS, max_size=40))
    if math.prod(shape) * ITEMSIZE[dtype] > 4096:
        shape.insert(draw(st.integers(0, len(shape))), 0)  # empty, its other dims huge
    raw_len = math.prod(shape) * ITEMSIZE[dtype]
    payload = draw(st.binary(min_size=raw_len, max_size=raw_len))
    header = FrameHeader(
        codec="raw",
        kind=draw(st.sampled_from(["tensor", "ndarray"])),
        dtype=dtype,
        shape=shape,
        raw_len=raw_len,
        payload_len=raw_len,
        checksum=xxhash.xxh3_64_intdigest(payload),
        fmt=draw(st.one_of(st.integers(0, 8), st.integers(-1, 2**40))),
        created_at=time.time(),
        ttl=draw(st.one_of(st.none(), st.sampled_from([3600.0, float("nan"), -1.0, 1e308]))),
    )
    return signed_head(header) + payload, None


@settings(SETTINGS, max_examples=200)
@given(frame=st.one_of(frames(), described_frames()))
def test_frames_are_stored_as_described_or_refused(
    client: httpx.Client, frame: tuple[bytes, bytes | None]
) -> None:
    blob, original = frame
    r = client.put("/v1/objects/framed", content=blob, headers={"content-type": FRAME})
    event(f"status {r.status_code}" + (" (valid frame)" if original is not None else ""))
    if r.status_code != 204:
        assert original is None, "a valid frame was refused: " + r.text
        assert_client_error(r)
        return
    header = parse_header(blob)[0]
    if header.ttl is not None and header.ttl < 3600:
        return  # may have expired already
    back = read_back(client, "framed")
    assert len(back.content) == header.raw_len
    if original is not None:
        assert back.content == original
    kind = "bytes" if header.kind in BYTE_KINDS else header.kind
    assert back.headers["x-kvgate-kind"] == kind
    assert back.headers["x-kvgate-dtype"] == header.dtype
    assert back.headers["x-kvgate-shape"] == ",".join(map(str, header.shape))
    assert back.headers["x-kvgate-format"] == str(header.fmt)
    # The frame the gateway answers with is the object again, in any codec.
    again = client.get("/v1/objects/framed", headers={"accept": FRAME})
    assert again.status_code == 200
    assert client.delete("/v1/objects/framed").status_code == 204
    r = client.put("/v1/objects/framed", content=again.content, headers={"content-type": FRAME})
    assert r.status_code == 204
    assert read_back(client, "framed").content == back.content
    # That frame is bound to its key: under another one it is refused.
    r = client.put("/v1/objects/again", content=again.content, headers={"content-type": FRAME})
    assert r.status_code == 400


@settings(SETTINGS, max_examples=50)
@given(
    entries=st.lists(st.tuples(st.sampled_from(["a", "b", "c/d"]), frames()), max_size=4),
    junk=st.one_of(st.none(), st.binary(max_size=24)),
)
def test_batch_puts_store_their_entries_or_refuse(
    client: httpx.Client, entries: list[tuple[str, tuple[bytes, bytes | None]]], junk: bytes | None
) -> None:
    body = b"".join(
        struct.pack("<H", len(key)) + key.encode() + struct.pack("<Q", len(blob)) + blob
        for key, (blob, _) in entries
    )
    body += junk or b""
    r = client.post("/v1/batch/put", content=body, headers={"content-type": FRAMES})
    event(f"status {r.status_code}")
    if r.status_code != 204:
        assert_client_error(r)
        return
    final = {key: (blob, original) for key, (blob, original) in entries}
    for key, (blob, original) in final.items():
        header = parse_header(blob)[0]
        if header.ttl is not None and header.ttl < 3600:
            continue
        back = read_back(client, key)
        assert len(back.content) == header.raw_len
        if original is not None:
            assert back.content == original


# -- declared lengths and chunked bodies over a raw socket -------------------------------------

LENGTHS = st.one_of(
    st.integers(0, 64).map(str),
    st.sampled_from(["-1", "1e3", " 5", "5 ", "0x10", "+5", "", str(2**64), str(MAX_BODY + 1)]),
)


def exchange(port: int, request: bytes) -> bytes:
    """Send ``request`` (which asks to close the connection), then read until the server
    closes it. A body shorter than declared is answered once the body timeout passes."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        with contextlib.suppress(OSError):  # the server answered and closed meanwhile
            sock.sendall(request)
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except ConnectionResetError:
            pass
        except TimeoutError:
            raise AssertionError(f"no answer within 5 s; got {data[:200]!r}") from None
    return data


@settings(SETTINGS, max_examples=60)
@given(
    declared=st.one_of(st.none(), LENGTHS),
    chunked=st.one_of(st.none(), st.sampled_from(["chunked", "gzip, chunked", "bogus"])),
    chunks=st.lists(
        st.tuples(
            st.one_of(st.none(), st.sampled_from(["zz", "-1", "ffffffffffffffffff"])),
            st.binary(max_size=40),
        ),
        max_size=3,
    ),
    body=st.binary(max_size=80),
    dtype=st.one_of(st.none(), st.sampled_from(["float16", "float32", "bfloat16"])),
)
def test_declared_lengths_never_fail_the_server(
    base_url: str,
    client: httpx.Client,
    declared: str | None,
    chunked: str | None,
    chunks: list[tuple[str | None, bytes]],
    body: bytes,
    dtype: str | None,
) -> None:
    port = int(base_url.rsplit(":", 1)[1])
    head = b"PUT /v1/objects/raw HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    if dtype is not None:
        head += b"x-kvgate-dtype: %s\r\n" % dtype.encode()
    if declared is not None:
        head += b"Content-Length: %s\r\n" % declared.encode()
    if chunked is not None:
        head += b"Transfer-Encoding: %s\r\n" % chunked.encode()
        body = b"".join(
            (size or f"{len(data):x}").encode() + b"\r\n" + data + b"\r\n" for size, data in chunks
        ) + (b"0\r\n\r\n" if chunks else b"")
    answer = exchange(port, head + b"\r\n" + body)
    event(answer.partition(b"\r\n")[0].decode(errors="replace") or "closed")
    if answer:
        status_line, _, rest = answer.partition(b"\r\n")
        status = int(status_line.split(b" ", 2)[1])
        assert status == 204 or 400 <= status < 500, answer[:300]
        headers, _, content = rest.partition(b"\r\n\r\n")
        if b"application/json" in headers.lower():
            assert set(json.loads(content.split(b"HTTP/1.1 ")[0])) == {"error", "detail"}
    assert client.get("/healthz").status_code == 200  # and it still serves


def test_the_fuzz_reaches_both_outcomes(client: httpx.Client) -> None:
    """A guard on the generators above: valid objects and frames are stored."""
    assert client.put("/v1/objects/ok", content=b"abc").status_code == 204
    data = to_object_data(np.arange(4, dtype=np.float32), 1)
    head, parts, _ = encode_frame(load_codec("zstd"), data)
    blob = head + b"".join(bytes(p) for p in parts)
    r = client.put("/v1/objects/ok", content=blob, headers={"content-type": FRAME})
    assert r.status_code == 204
    assert read_back(client, "ok").content == np.arange(4, dtype=np.float32).tobytes()
