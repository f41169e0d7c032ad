"""The Codec contract: how object bytes are turned into a frame payload and back.

A codec is built with its options (``load_codec("zstd", level=3)``), encodes an
``ObjectData`` (which carries dtype, shape and memory format, and the torch tensor itself when
there is one, so GPU codecs can encode on the device), and decodes from the payload plus what
the frame header records. Nothing travels beside the frame: no side channel, no pickle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from gateway.connector import as_parts
from gateway.frame import FrameInfo, encode_header
from gateway.types import Buffer, BufferParts, ParamValue

if TYPE_CHECKING:
    from gateway.objects import ObjectData, ObjectMeta


@runtime_checkable
class Codec(Protocol):
    name: str
    lossless: bool

    def encode(self, obj: ObjectData) -> tuple[BufferParts, dict[str, ParamValue]]:
        """Payload (one buffer or a scatter list) and the params to record in the frame."""
        ...

    def decode(self, payload: memoryview, info: FrameInfo, out: memoryview | None) -> Buffer:
        """The object's raw bytes (``info.raw_len`` of them).

        When ``out`` is given (a writable buffer of ``info.raw_len`` bytes), the codec should
        write into it and return it; it may return another buffer instead. Malformed payloads
        raise ``CorruptObject``.
        """
        ...


def frame_head(
    codec: str,
    meta: ObjectMeta,
    parts: list[memoryview],
    params: dict[str, ParamValue],
    ttl: float | None = None,
    checksum: int | None = None,
    key: str | None = None,
) -> tuple[bytes, FrameInfo]:
    """The frame head (prefix, header, padding) of an object's encoded payload parts.

    ``checksum``: the payload's xxh3_64 when the caller already has it (else it is hashed).
    ``key``: the key the frame will be stored or sent under (the frame is bound to it).
    """
    return encode_header(
        codec=codec,
        kind=meta.kind,
        dtype=meta.dtype,
        shape=meta.shape,
        raw_len=meta.nbytes,
        payload=parts,
        fmt=meta.fmt,
        params=params,
        ttl=ttl,
        checksum=checksum,
        key=key,
    )


def encode_frame(
    codec: Codec, obj: ObjectData, key: str | None = None
) -> tuple[bytes, list[memoryview], FrameInfo]:
    """Encode ``obj`` as a tier writes it: the frame head, the payload parts and the header.

    The blob is ``head + b"".join(parts)``; nothing is copied here. ``key``: see ``frame_head``.
    """
    payload, params = codec.encode(obj)
    parts = as_parts(payload)
    head, header = frame_head(codec.name, obj.meta, parts, params, key=key)
    return head, parts, header
