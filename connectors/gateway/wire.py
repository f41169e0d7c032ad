"""How the Connector contract's keys and bytes travel through the HTTP object API.

Keys: a key the remote's Store accepts goes as it is, percent-encoded into one path segment, so
the remote's own clients see the same key. Any other key (control characters, lone surrogates)
and any key that starts with ``ESCAPED`` goes as ``ESCAPED`` + base64url of its UTF-8, which
cannot collide with a key sent as it is.

Bytes: what a tier writes is a kvgate frame; it goes with the frame media type, and the remote
verifies and decodes it, so the remote holds a real object. A connector must also carry bytes
that are not a frame (the conformance suite writes plain bytes, and a corrupted frame written
back must read back corrupted, not be repaired or refused). Those go as a plain ``bytes``
object whose content is ``OPAQUE`` followed by the bytes; a GET answer of a ``bytes`` object
that starts with ``OPAQUE`` gives back the bytes after it. ``OPAQUE`` is 16 bytes with NULs and
a version byte, which no frame and, in practice, no user object starts with.
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Sequence
from urllib.parse import quote

from gateway.errors import CorruptObject, GatewayError
from gateway.frame import MAGIC, MAX_HEADER_LEN, PREFIX_LEN, decode_frame, parse_header
from gateway.keys import MAX_KEY_BYTES, normalize_key
from gateway.registry import load_codec
from gateway.types import BYTE_KINDS

ESCAPED = "~kvgate-escaped~"
OPAQUE = b"\x00kvgate-opaque\x00\x01"
FRAME_TYPE = "application/vnd.kvgate.frame"
BYTES_TYPE = "application/octet-stream"
MAX_BATCH_KEYS = 65536  # keys the service takes in one lookup or exists request


def remote_key(key: str) -> str | None:
    """The key the remote stores ``key`` under; None if it cannot be carried (too long)."""
    if not key.startswith(ESCAPED):
        try:
            return normalize_key(key)
        except GatewayError:
            pass
    if not key:
        return None
    text = ESCAPED + base64.urlsafe_b64encode(key.encode("utf-8", "surrogatepass")).decode()
    return text if len(text) <= MAX_KEY_BYTES else None


def object_path(remote: str) -> str:
    """``/v1/objects/<key>``: the key as one path segment ("." and ".." escaped too)."""
    segment = quote(remote, safe="")
    if segment in (".", ".."):
        segment = segment.replace(".", "%2E")
    return f"/v1/objects/{segment}"


def _leading(parts: Sequence[memoryview], n: int) -> memoryview:
    """The first ``n`` bytes of the scatter list (no copy when the first part holds them)."""
    if parts and parts[0].nbytes >= n:
        return parts[0][:n]
    out = bytearray()
    for part in parts:
        out += part[: n - len(out)]
        if len(out) >= n:
            break
    return memoryview(out)


def is_frame(parts: Sequence[memoryview], total: int) -> bool:
    """Whether the bytes are shaped like a frame (prefix, header, length); payloads unchecked.

    The remote verifies the checksum; a frame it refuses as corrupt is sent again as opaque
    bytes (``GatewayConnector.put``), so the common case costs no pass over the payload here.
    """
    if total < PREFIX_LEN or bytes(_leading(parts, 4)) != MAGIC:
        return False
    (header_len,) = struct.unpack_from("<I", _leading(parts, PREFIX_LEN), 8)
    if header_len > MAX_HEADER_LEN or PREFIX_LEN + header_len > total:
        return False
    try:
        header, offset = parse_header(_leading(parts, min(total, PREFIX_LEN + header_len + 64)))
    except CorruptObject:
        return False
    return total == offset + header.payload_len


def unwrap(blob: bytes) -> memoryview:
    """What a GET answer (a frame) holds for the caller: the frame, or opaque bytes."""
    view = memoryview(blob)
    try:
        header, offset = parse_header(view)
    except CorruptObject:
        return view  # the reader verifies and counts it
    # The server may answer with any bytes-like kind (it keeps plain bodies as memoryviews).
    if header.kind not in BYTE_KINDS or header.raw_len < len(OPAQUE):
        return view
    if header.codec == "raw":
        if view[offset : offset + len(OPAQUE)] != OPAQUE:
            return view
        header, payload = decode_frame(view)  # verified: the caller cannot check these bytes
        return payload[len(OPAQUE) :]
    header, payload = decode_frame(view)
    raw = memoryview(load_codec(header.codec).decode(payload, header, None)).cast("B")
    return raw[len(OPAQUE) :] if raw[: len(OPAQUE)] == OPAQUE else view


def unwrap_plain(body: bytes) -> memoryview:
    """What a plain-payload GET answer holds: the bytes, less ``OPAQUE`` when they start so."""
    view = memoryview(body)
    return view[len(OPAQUE) :] if view[: len(OPAQUE)] == OPAQUE else view


def exists_answer(body: bytes, count: int, where: str) -> list[bool]:
    """The ``exists`` list of a ``POST /v1/exists`` answer, checked: ``count`` booleans."""
    try:
        flags = json.loads(body)["exists"]
    except (ValueError, KeyError, TypeError) as exc:
        raise GatewayError(f"{where}: the answer is not {{'exists': [...]}}: {exc}") from None
    if not isinstance(flags, list) or len(flags) != count:
        raise GatewayError(f"{where}: asked about {count} keys, the answer has another count")
    if not all(isinstance(f, bool) for f in flags):
        raise GatewayError(f"{where}: the answer's 'exists' holds something other than true/false")
    return flags
