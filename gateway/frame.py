"""The self-describing object frame: every object below L1 is one of these blobs.

Layout (little-endian)::

    offset 0   magic  b"KVGF"
           4   version u8 (2; 1 is still read), flags u8 (0), reserved u16 (0)
           8   header_len u32
          12   header_check u32  = xxh32(bytes 0..12 + header)
          16   header: msgpack of FrameHeader, header_len bytes
               zero padding up to payload_offset = align_up(16 + header_len, 64)
               payload: header.payload_len bytes, xxh3_64 == header.checksum

One blob per object keeps every write atomic on every backend. The payload starts on a
64-byte boundary so that a blob read into a pool buffer can be viewed as a tensor in place.
Every byte is covered: the prefix and header by ``header_check``, the padding must be zero,
the payload by ``checksum`` and the total length by ``payload_len``; a mangled blob is always a
``CorruptObject``, never a crash and never a wrong object.

A frame is bound to the key it was written under: the header records ``key_hash``, the xxh3_64
of the key, and a reader that knows which key it asked for (``decode_frame(..., key=)``)
refuses a frame written under another one as corrupt. So a value moved or copied to another
key in a backend (two values swapped in Redis, an S3 object renamed) is a miss, never the other
key's object. Version 1 frames, written before the binding existed, have no ``key_hash``; they
are still read (a cache written by an older kvgate stays usable) and are bound to nothing.
Version 2 frames without one (a client building frames with ``encode_header`` and no key)
are unbound too. Whatever writes a frame for a key through a tier binds it.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Sequence

import msgspec
import xxhash

from gateway.errors import CorruptObject, ForeignObject
from gateway.types import Buffer, ObjectKind, ParamValue

MAGIC = b"KVGF"
VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: before key binding (no key_hash)
PREFIX = struct.Struct("<4sBBHII")
PREFIX_LEN = PREFIX.size  # 16
ALIGN = 64
MAX_HEADER_LEN = 1 << 20


class FrameHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a reader needs to verify and decode the payload. ``FrameInfo`` for codecs."""

    codec: str
    kind: ObjectKind
    dtype: str
    shape: list[int]
    raw_len: int
    payload_len: int
    checksum: int
    fmt: int = 0
    params: dict[str, ParamValue] = msgspec.field(default_factory=dict)
    created_at: float = 0.0
    ttl: float | None = None
    key_hash: int | None = None  # xxh3_64 of the key written under (``key_digest``); None: unbound

    def expired(self, now: float | None = None) -> bool:
        if self.ttl is None:
            return False
        return (time.time() if now is None else now) > self.created_at + self.ttl


FrameInfo = FrameHeader

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(FrameHeader)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def payload_offset_of(header_len: int) -> int:
    """Where the payload starts in a frame whose header is ``header_len`` bytes."""
    return _align(PREFIX_LEN + header_len)


def key_digest(key: str) -> int:
    """What binds a frame to its key: the xxh3_64 of the key's UTF-8 (lone surrogates kept)."""
    return xxhash.xxh3_64_intdigest(key.encode("utf-8", "surrogatepass"))


def check_key(header: FrameHeader, key: str | None) -> None:
    """Raise ``CorruptObject`` when ``header`` is bound to a key other than ``key``.

    ``key`` None: the reader does not know the key (nothing to check). An unbound frame
    (version 1, or written without a key) passes: see the module's docstring.
    """
    if key is not None and header.key_hash is not None and header.key_hash != key_digest(key):
        raise CorruptObject("the frame was written under another key")


def payload_checksum(payload: Buffer | Sequence[Buffer]) -> int:
    if isinstance(payload, bytes | bytearray | memoryview):
        return xxhash.xxh3_64_intdigest(payload)
    h = xxhash.xxh3_64()
    for part in payload:
        h.update(part)
    return h.intdigest()


def encode_header(
    *,
    codec: str,
    kind: ObjectKind,
    dtype: str,
    shape: Sequence[int],
    raw_len: int,
    payload: Buffer | Sequence[Buffer],
    fmt: int = 0,
    params: dict[str, ParamValue] | None = None,
    ttl: float | None = None,
    checksum: int | None = None,
    key: str | None = None,
) -> tuple[bytes, FrameHeader]:
    """Build the prefix + header + padding for ``payload``; the frame is ``head + payload``.

    The payload is not copied: callers write ``[head, payload...]`` as a scatter list.
    ``key``: the key the frame is written under, which it is then bound to.
    """
    parts = [payload] if isinstance(payload, bytes | bytearray | memoryview) else list(payload)
    payload_len = sum(memoryview(p).nbytes for p in parts)
    header = FrameHeader(
        codec=codec,
        kind=kind,
        dtype=dtype,
        shape=list(shape),
        raw_len=raw_len,
        payload_len=payload_len,
        checksum=payload_checksum(parts) if checksum is None else checksum,
        fmt=fmt,
        params=params or {},
        created_at=time.time(),
        ttl=ttl,
        key_hash=None if key is None else key_digest(key),
    )
    body = _encoder.encode(header)
    start = struct.pack("<4sBBHI", MAGIC, VERSION, 0, 0, len(body))
    check = xxhash.xxh32_intdigest(start + body)
    head = start + struct.pack("<I", check) + body
    return head + bytes(_align(len(head)) - len(head)), header


def parse_header(blob: Buffer) -> tuple[FrameHeader, int]:
    """Read and check the prefix and header; returns the header and the payload offset.

    Needs only the first ``payload_offset`` bytes of the blob (the fs connector reads headers
    alone when it rebuilds its index). Raises ``CorruptObject`` on any inconsistency.
    """
    view = memoryview(blob).cast("B")
    if view.nbytes < PREFIX_LEN:
        ours = view.nbytes >= len(MAGIC) and bytes(view[: len(MAGIC)]) == MAGIC
        raise (CorruptObject if ours else ForeignObject)(f"frame too short: {view.nbytes} bytes")
    magic, version, flags, reserved, header_len, check = PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise ForeignObject("bad frame magic: not a kvgate frame")
    if header_len > MAX_HEADER_LEN or PREFIX_LEN + header_len > view.nbytes:
        raise CorruptObject(f"frame header length {header_len} exceeds the blob")
    body = view[PREFIX_LEN : PREFIX_LEN + header_len]
    if xxhash.xxh32_intdigest(bytes(view[:12]) + bytes(body)) != check:
        raise CorruptObject("frame header checksum mismatch")
    # A newer kvgate's frame, in a backend shared during a rolling upgrade: left for it. Its
    # prefix and header checksum are the ones above (every version keeps them), so a flipped
    # version byte is corrupt, not foreign.
    if version > VERSION:
        raise ForeignObject(f"frame version {version} is newer than this kvgate reads")
    if version not in READABLE_VERSIONS or flags != 0 or reserved != 0:
        raise CorruptObject(f"unknown frame version {version} (flags {flags})")
    try:
        header = _decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:  # pragma: no cover - checked
        raise CorruptObject(f"undecodable frame header: {exc}") from None
    if header.payload_len < 0 or header.raw_len < 0 or any(d < 0 for d in header.shape):
        raise CorruptObject("negative length or dimension in frame header")
    if version == 1 and header.key_hash is not None:
        raise CorruptObject("a version 1 frame header with a key binding")
    offset = payload_offset_of(header_len)
    pad = view[PREFIX_LEN + header_len : min(offset, view.nbytes)]
    if pad.nbytes and any(pad):
        raise CorruptObject("non-zero frame padding")
    return header, offset


def decode_frame(
    blob: Buffer, *, verify: bool = True, digest: int | None = None, key: str | None = None
) -> tuple[FrameHeader, memoryview]:
    """Split a whole blob into its header and a zero-copy payload view, verifying both.

    ``digest``: the payload's xxh3_64, already computed while the blob was read
    (``StreamingChecksum``); it is compared instead of hashing the payload again.
    ``key``: the key the blob was read under; a frame bound to another is ``CorruptObject``.
    """
    view = memoryview(blob).cast("B")
    header, offset = parse_header(view)
    check_key(header, key)
    if view.nbytes != offset + header.payload_len:
        raise CorruptObject(
            f"frame length {view.nbytes} != {offset + header.payload_len} declared (truncated "
            "or trailing bytes)"
        )
    payload = view[offset:]
    if digest is None and verify:
        digest = xxhash.xxh3_64_intdigest(payload)
    if digest is not None and digest != header.checksum:
        raise CorruptObject("payload checksum mismatch")
    return header, payload
