"""LMCache's ``lm://`` wire format (lmcache 0.5.6 ``lmcache/v1/protocol.py``), in one place.

Fixed-size structs of native-order int32 (little-endian on every Linux target LMCache runs on),
no magic, no version; one request at a time per connection (REFERENCE §1):

- request, 186 bytes: command, length, format, dtype code, location, shape[4], key (150 bytes,
  UTF-8, right-padded with spaces);
- reply, 36 bytes: code (200 / 400), length, format, dtype code, shape[4], location.

``parse_request`` and ``parse_reply`` accept only what LMCache itself can decode (known
command, format, dtype and location codes; a non-negative length) and raise ``WireError``
otherwise, so that the server and the connector validate the same way.

Two kvgate extensions, invisible to LMCache's client (it never sends or checks them):

- a *tombstone*: a PUT of length 0 with format UNDEFINED, dtype code 0 and ``TOMBSTONE_SHAPE``.
  The protocol has no DELETE; kvgate's server deletes the key when it receives one, and the
  stock server stores it, where kvgate's connector reads it back as a miss;
- ``KVGATE_MARK`` in the last shape slot of a HEALTH reply, which tells kvgate's connector that
  the server is kvgate (tombstones delete, so EXIST is exact).
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

KEY_BYTES = 150
REQUEST = struct.Struct(f"=9i{KEY_BYTES}s")  # "=": native order, standard sizes, no padding
REPLY = struct.Struct("=9i")
assert REQUEST.size == 186
assert REPLY.size == 36

INT32_MAX = (1 << 31) - 1
KVGATE_MARK = 0x6B766774  # "kvgt"
TOMBSTONE_SHAPE = (0, 0, 0, KVGATE_MARK)


class WireError(ValueError):
    """Bytes that are not a valid lm:// header."""


class Command(enum.IntEnum):
    PUT = 1
    GET = 2
    EXIST = 3
    LIST = 4
    HEALTH = 5


class Code(enum.IntEnum):
    OK = 200
    FAIL = 400


class Format(enum.IntEnum):
    """LMCache's ``MemoryFormat`` values (they travel on the wire)."""

    UNDEFINED = 0
    KV_2LTD = 1
    KV_T2D = 2
    KV_2TD = 3
    BINARY = 4
    BINARY_BUFFER = 5
    KV_MLA_FMT = 6
    EC_TD = 7
    HS_TD = 8


DTYPE_OF_CODE: dict[int, str | None] = {
    0: None,
    1: "float16",  # LMCache's torch.half; it answers 2 for it, being the same torch dtype
    2: "float16",
    3: "bfloat16",
    4: "float32",
    5: "float64",
    6: "uint8",
    7: "float8_e4m3fn",
    8: "float8_e5m2",
}
"""Wire dtype code -> canonical dtype name (torch's, without ``torch.``); 0 is no dtype."""

CODE_OF_DTYPE: dict[str, int] = {
    "float16": 2,
    "bfloat16": 3,
    "float32": 4,
    "float64": 5,
    "uint8": 6,
    "float8_e4m3fn": 7,
    "float8_e5m2": 8,
}
"""What LMCache sends for each dtype (``DTYPE_TO_INT``); other dtypes have no code."""

_LOCATIONS = range(3)  # none, LocalCPUBackend, LocalDiskBackend

Shape4 = tuple[int, int, int, int]


@dataclass(frozen=True, slots=True)
class Request:
    command: Command
    key: str
    length: int = 0
    fmt: int = Format.UNDEFINED
    dtype: int = 0
    shape: Shape4 = (0, 0, 0, 0)
    location: int = 0

    @property
    def is_tombstone(self) -> bool:
        return self.command == Command.PUT and _tombstone(
            self.length, self.fmt, self.dtype, self.shape
        )


@dataclass(frozen=True, slots=True)
class Reply:
    code: int
    length: int = 0
    fmt: int = Format.KV_2LTD
    dtype: int = 2
    shape: Shape4 = (0, 0, 0, 0)
    location: int = 0

    @property
    def is_tombstone(self) -> bool:
        return _tombstone(self.length, self.fmt, self.dtype, self.shape)


def _tombstone(length: int, fmt: int, dtype: int, shape: Shape4) -> bool:
    """The header fields of a tombstone (an empty PUT that marks a delete; no DELETE exists)."""
    return length == 0 and fmt == Format.UNDEFINED and dtype == 0 and shape == TOMBSTONE_SHAPE


# What the stock server answers for a miss, a failed EXIST and a HEALTH check.
MISS = Reply(Code.FAIL)
FOUND = Reply(Code.OK)
HEALTHY = Reply(Code.OK, shape=(0, 0, 0, KVGATE_MARK))


def pad_shape(shape: tuple[int, ...]) -> Shape4 | None:
    """``shape`` as the wire's four dims (trailing zeros), or None if it cannot travel."""
    if len(shape) > 4 or any(d < 0 or d > INT32_MAX for d in shape):
        return None
    a, b, c, d = (*shape, 0, 0, 0, 0)[:4]
    return (a, b, c, d)


def strip_shape(dims: Shape4) -> tuple[int, ...]:
    """The shape a padded one stands for: trailing zeros dropped, at least one dim kept."""
    end = 4
    while end > 1 and dims[end - 1] == 0:
        end -= 1
    return dims[:end]


def _check_common(length: int, fmt: int, dtype: int, dims: Shape4, location: int) -> None:
    if length < 0:
        raise WireError(f"negative length {length}")
    if fmt not in Format._value2member_map_:
        raise WireError(f"unknown memory format {fmt}")
    if dtype not in DTYPE_OF_CODE:
        raise WireError(f"unknown dtype code {dtype}")
    if location not in _LOCATIONS:
        raise WireError(f"unknown location {location}")
    if any(d < 0 for d in dims):
        raise WireError(f"negative dimension in shape {list(dims)}")


def encode_request(req: Request) -> bytes:
    raw = req.key.encode("utf-8")
    if len(raw) > KEY_BYTES:
        raise WireError(f"key is {len(raw)} bytes; lm:// carries at most {KEY_BYTES}")
    _check_common(req.length, req.fmt, req.dtype, req.shape, req.location)
    if req.length > INT32_MAX:
        raise WireError(f"length {req.length} does not fit lm://'s int32")
    return REQUEST.pack(
        req.command, req.length, req.fmt, req.dtype, req.location, *req.shape, raw.ljust(KEY_BYTES)
    )


def parse_request(data: bytes | bytearray | memoryview) -> Request:
    if len(data) != REQUEST.size:
        raise WireError(f"request header is {len(data)} bytes, not {REQUEST.size}")
    command, length, fmt, dtype, location, d0, d1, d2, d3, raw = REQUEST.unpack(data)
    if command not in Command._value2member_map_:
        raise WireError(f"unknown command {command}")
    dims = (d0, d1, d2, d3)
    _check_common(length, fmt, dtype, dims, location)
    try:
        key = raw.decode("utf-8").strip()  # LMCache strips both ends too
    except UnicodeDecodeError as exc:
        raise WireError("key is not UTF-8") from exc
    return Request(Command(command), key, length, fmt, dtype, dims, location)


def encode_reply(reply: Reply) -> bytes:
    _check_common(reply.length, reply.fmt, reply.dtype, reply.shape, reply.location)
    return REPLY.pack(
        reply.code, reply.length, reply.fmt, reply.dtype, *reply.shape, reply.location
    )


def parse_reply(data: bytes | bytearray | memoryview) -> Reply:
    if len(data) != REPLY.size:
        raise WireError(f"reply header is {len(data)} bytes, not {REPLY.size}")
    code, length, fmt, dtype, d0, d1, d2, d3, location = REPLY.unpack(data)
    if code not in Code._value2member_map_:
        raise WireError(f"unknown reply code {code}")
    dims = (d0, d1, d2, d3)
    _check_common(length, fmt, dtype, dims, location)
    return Reply(code, length, fmt, dtype, dims, location)
