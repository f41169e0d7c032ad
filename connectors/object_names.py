"""Keys to object names and back, without collisions and with prefix listing intact.

Shared by the object-store connectors (``s3://``, ``azure://``, ``gs://``): each allows object
names of at most 1024 bytes (Azure: 1024 characters), and S3-compatible servers add their
own limits
(SeaweedFS and MinIO store names as paths: at most 255 bytes per ``/`` segment, and MinIO
refuses an object ``a`` next to an object ``a/b``). Keys are arbitrary strings, so:

- Every byte of the key's UTF-8 form that is not ``[A-Za-z0-9-]`` becomes ``_XX`` (two
  upper-case hex digits; ``_`` itself is escaped). The escape is injective, keeps plain keys
  readable in the bucket, and no name holds ``/``, ``.``, ``..``, ``%``, NUL or control bytes.
- The escaped text is cut into segments of ``SEGMENT`` characters joined by ``/``, and the name
  ends in ``.``: a file name never equals a directory name, and no segment is over 255 bytes.
- Escaping is byte by byte and the cuts fall at fixed offsets, so the name of a key prefix is a
  prefix of the names of its keys: ``list(prefix)`` is one ``ListObjectsV2`` by name prefix.
- A name that would exceed ``MAX_NAME`` bytes keeps its first bytes (still listable by prefix)
  and ends in ``!`` plus a 160-bit BLAKE2b of the key instead of ``.``; the full key travels in
  the object's metadata (``x-amz-meta-kvgate-key``, base64; Azure's metadata names must be
  identifiers, so there it is ``kvgate_key``) for ``list`` to read back.
  S3 limits user metadata to 2 KiB, hence ``MAX_KEY_BYTES``.
"""

from __future__ import annotations

import base64
import hashlib
import re
from dataclasses import dataclass

SEGMENT = 200
MAX_NAME = 1024
MAX_KEY_BYTES = 1500
"""Longest key (UTF-8 bytes): its base64 form must fit in S3's 2 KiB of user metadata."""
KEY_META = "kvgate-key"
_HASH_HEX = 40  # 160 bits

_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-")
_ESCAPE = [chr(b) if b in _SAFE else f"_{b:02X}" for b in range(256)]
_ESCAPED_RE = re.compile(r"_([0-9A-F]{2})|([A-Za-z0-9-])")
_ESCAPED_CHARS_RE = re.compile(r"[A-Za-z0-9_-]+")  # a hashed name's kept text may end mid-escape
_HASH_RE = re.compile(rf"[0-9a-f]{{{_HASH_HEX}}}")


def escape(key: str) -> str:
    return "".join(_ESCAPE[b] for b in key.encode())


def unescape(text: str) -> str | None:
    """The key whose escape is ``text``; None if ``text`` is not one (a foreign object)."""
    out = bytearray()
    pos = 0
    for match in _ESCAPED_RE.finditer(text):
        if match.start() != pos:
            return None
        hex_digits, plain = match.groups()
        out.append(int(hex_digits, 16) if hex_digits else ord(plain))
        pos = match.end()
    if pos != len(text):
        return None
    try:
        return out.decode()
    except UnicodeDecodeError:
        return None


def _segments(text: str) -> str:
    return "/".join(text[i : i + SEGMENT] for i in range(0, len(text), SEGMENT))


@dataclass(frozen=True, slots=True)
class Naming:
    """The names of keys under one bucket prefix (``""`` or ending in ``/``)."""

    prefix: str

    @property
    def _room(self) -> int:
        """Escaped characters a hashed name keeps: the rest of MAX_NAME after the prefix,
        the segment slashes, the ``!`` and the hash."""
        room = MAX_NAME - len(self.prefix.encode()) - 1 - _HASH_HEX
        return room - room // (SEGMENT + 1)

    def object_name(self, key: str) -> str:
        """The object name of ``key`` (the caller has checked its length)."""
        escaped = escape(key)
        name = f"{self.prefix}{_segments(escaped)}."
        if len(name) <= MAX_NAME:
            return name
        digest = hashlib.blake2b(key.encode(), digest_size=_HASH_HEX // 2).hexdigest()
        return f"{self.prefix}{_segments(escaped[: self._room])}!{digest}"

    def is_hashed(self, name: str) -> bool:
        return not name.endswith(".")

    def list_prefix(self, key_prefix: str) -> str:
        """The name prefix that every object whose key starts with ``key_prefix`` has."""
        escaped = escape(key_prefix)
        if len(escaped) > self._room:  # hashed names keep only _room characters
            escaped = escaped[: self._room]
        return f"{self.prefix}{_segments(escaped)}"

    def key_of(self, name: str) -> str | None:
        """The key of a plain (unhashed) name; None for a name that is not one of ours."""
        if not name.startswith(self.prefix) or not name.endswith("."):
            return None
        body = name[len(self.prefix) : -1]
        segments = body.split("/")
        if any(len(s) != SEGMENT for s in segments[:-1]) or not 0 < len(segments[-1]) <= SEGMENT:
            return None
        return unescape("".join(segments))

    def is_ours(self, name: str) -> bool:
        """Whether ``name`` is one that ``object_name`` gives for some key (plain or hashed)."""
        if self.key_of(name) is not None:
            return True
        body = name[len(self.prefix) :] if name.startswith(self.prefix) else ""
        head, bang, digest = body.rpartition("!")
        segments = head.split("/")
        return (
            bool(bang)
            and _HASH_RE.fullmatch(digest) is not None
            and all(len(s) == SEGMENT for s in segments[:-1])
            and 0 < len(segments[-1]) <= SEGMENT
            and all(_ESCAPED_CHARS_RE.fullmatch(s) for s in segments)
        )


def shown(name: str) -> str:
    """``name`` quoted for a message, its middle cut when it is long (hashed names are ~1 KiB)."""
    return repr(name if len(name) <= 120 else f"{name[:70]}...{name[-40:]}")


def key_metadata(key: str, field: str = KEY_META) -> dict[str, str]:
    return {field: base64.b64encode(key.encode()).decode()}


def key_from_metadata(metadata: dict[str, str], field: str = KEY_META) -> str | None:
    value = metadata.get(field)
    if value is None:
        return None
    try:
        return base64.b64decode(value, validate=True).decode()
    except (ValueError, UnicodeDecodeError):
        return None
