"""The Codec contract: how object bytes are turned into a frame payload and back.

A codec is built with its options (``load_codec("zstd", level=3)``), encodes an
``ObjectData`` (which carries dtype, shape and memory format, and the torch tensor itself when
there is one, so GPU codecs can encode on the device), and decodes from the payload plus what
the frame header records. Nothing travels beside the frame: no side channel, no pickle.

A *keyed* codec (``keyed = True``: ``aesgcm``) binds its payload to the key the object is stored
under and to what the header says about the object, so that a payload moved to another key or
a header rewritten (another dtype, shape or codec chain) fails to decode instead of giving
wrong bytes. It is called through ``encode_payload`` / ``decode_payload``, which hand it that
binding (``frame_binding``: the real key, not a hash of it); its plain ``encode``/``decode``
refuse to work without one, so no path can silently skip the binding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, cast, runtime_checkable

import msgspec

from gateway.connector import as_parts
from gateway.errors import CorruptObject, Unsupported
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


@runtime_checkable
class KeyedCodec(Codec, Protocol):
    """A codec whose payload is bound to its frame (``binding``, see ``frame_binding``)."""

    keyed: bool  # True

    def encode_bound(
        self, obj: ObjectData, binding: bytes
    ) -> tuple[BufferParts, dict[str, ParamValue]]: ...

    def decode_bound(
        self, payload: memoryview, info: FrameInfo, out: memoryview | None, binding: bytes
    ) -> Buffer: ...


def is_keyed(codec: Codec) -> bool:
    """Whether ``codec`` must be given the frame binding (``encode_payload``)."""
    return bool(getattr(codec, "keyed", False))


_binding_encoder = msgspec.msgpack.Encoder()
BINDING_DOMAIN = "kvgate-frame-binding-v1"


def frame_binding(
    key: str, codec: str, kind: str, dtype: str, shape: Sequence[int], fmt: int, raw_len: int
) -> bytes:
    """What a keyed codec authenticates besides its payload: the object's key (its UTF-8, lone
    surrogates kept) and every header field that decides what the decoded bytes mean.

    The frame's ``created_at`` and ``ttl`` are not in it: they are set after encoding, so a
    writer to the backend can make an object expire sooner or later, never change its bytes.
    """
    return _binding_encoder.encode(
        [
            BINDING_DOMAIN,
            key.encode("utf-8", "surrogatepass"),
            codec,
            kind,
            dtype,
            [int(d) for d in shape],
            int(fmt),
            int(raw_len),
        ]
    )


def encode_payload(
    codec: Codec, obj: ObjectData, key: str | None = None
) -> tuple[BufferParts, dict[str, ParamValue]]:
    """``codec.encode(obj)``, or for a keyed codec its payload bound to ``key`` and the header.

    A keyed codec without a key is ``Unsupported``: its frame could not be bound to anything.
    """
    if not is_keyed(codec):
        return codec.encode(obj)
    if key is None:
        raise Unsupported(
            f"codec {codec.name!r} binds each object to its key: encode it with the key it is "
            "stored under (encode_frame(codec, obj, key))"
        )
    meta = obj.meta
    binding = frame_binding(
        key, codec.name, meta.kind, meta.dtype, meta.shape, meta.fmt, meta.nbytes
    )
    return cast(KeyedCodec, codec).encode_bound(obj, binding)


def decode_payload(
    codec: Codec,
    payload: memoryview,
    info: FrameInfo,
    out: memoryview | None,
    key: str | None = None,
) -> Buffer:
    """``codec.decode``, or for a keyed codec the decode checked against ``key`` and ``info``.

    A keyed frame read without its key is ``CorruptObject`` (a miss): nothing can vouch for it.
    """
    if not is_keyed(codec):
        return codec.decode(payload, info, out)
    if key is None:
        raise CorruptObject(f"a {info.codec!r} frame cannot be verified without its key")
    binding = frame_binding(
        key, info.codec, info.kind, info.dtype, info.shape, info.fmt, info.raw_len
    )
    return cast(KeyedCodec, codec).decode_bound(payload, info, out, binding)


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

    The blob is ``head + b"".join(parts)``; nothing is copied here. ``key``: see ``frame_head``;
    a keyed codec (``encode_payload``) needs it.
    """
    payload, params = encode_payload(codec, obj, key)
    parts = as_parts(payload)
    head, header = frame_head(codec.name, obj.meta, parts, params, key=key)
    return head, parts, header
