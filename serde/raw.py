"""``raw``: the object's bytes as they are (the payload is a zero-copy view)."""

from __future__ import annotations

from typing import Any

from gateway.errors import ConfigError, CorruptObject
from gateway.frame import FrameInfo
from gateway.objects import ObjectData
from gateway.types import Buffer, BufferParts, ParamValue


class RawCodec:
    name = "raw"
    lossless = True

    def __init__(self, **options: Any) -> None:
        if options:
            raise ConfigError(f"codec raw takes no options (got {', '.join(sorted(options))})")

    def encode(self, obj: ObjectData) -> tuple[BufferParts, dict[str, ParamValue]]:
        return obj.host(), {}

    def decode(self, payload: memoryview, info: FrameInfo, out: memoryview | None) -> Buffer:
        return decode_raw(payload, info, out)


def decode_raw(payload: memoryview, info: FrameInfo, out: memoryview | None) -> Buffer:
    """The payload is the object's bytes (also what lossy codecs store in their raw mode)."""
    if payload.nbytes != info.raw_len:
        raise CorruptObject(f"raw payload is {payload.nbytes} bytes, expected {info.raw_len}")
    if out is None:
        return payload
    out[:] = payload
    return out
