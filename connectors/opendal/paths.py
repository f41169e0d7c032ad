"""Keys to OpenDAL paths and back: any key, no collisions, no traversal, prefixes kept.

A key's UTF-8 bytes are written with ``[A-Za-z0-9_-]`` as they are and every other byte as
``%XX``, so ``/``, ``.``, ``..``, NUL and ``%`` itself can never act as path syntax, and two
keys never share a path. The name is cut into segments of SEGMENT characters (folders marked
with a ``+``) so that long keys stay under file-name limits (255 bytes on most filesystems);
a prefix's keys all live below the folders of its full segments (``list_root``), which is
what listing by prefix relies on. Nothing kvgate writes starts with ``.`` except its staging area.
"""

from __future__ import annotations

import re

SEGMENT = 200
STAGING = ".kvgate-staging/"
_PLAIN = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_NAME = re.compile(r"(?:[A-Za-z0-9_-]|%[0-9A-F]{2})+")


def encode(key: str) -> str:
    """The flat name of ``key`` (before it is cut into segments)."""
    raw = key.encode("utf-8", "surrogatepass")
    return "".join(chr(b) if b in _PLAIN else f"%{b:02X}" for b in raw)


def path_of(key: str) -> str:
    return segmented(encode(key))


def segmented(name: str) -> str:
    """``name`` cut into segments; every segment but the last ends with ``+`` (never in an
    encoded name), so a folder never has the name of a file: a key whose name is exactly
    200 characters and a longer key that starts with it live side by side."""
    chunks = [name[i : i + SEGMENT] for i in range(0, len(name), SEGMENT)] or [name]
    return "".join(c + "+/" for c in chunks[:-1]) + chunks[-1]


def key_of(path: str) -> str | None:
    """The key stored at ``path``, or None for a path kvgate would not have written."""
    segments = path.split("/")
    if not all(seg.endswith("+") for seg in segments[:-1]):
        return None
    name = "".join(seg[:-1] for seg in segments[:-1]) + segments[-1]
    if not name or encode_is_invalid(name) or segmented(name) != path:
        return None
    # Decode by walking the name: plain characters as themselves, escapes as their byte.
    out = bytearray()
    i = 0
    while i < len(name):
        if name[i] == "%":
            out.append(int(name[i + 1 : i + 3], 16))
            i += 3
        else:
            out.append(ord(name[i]))
            i += 1
    try:
        key = out.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return None
    return key if encode(key) == name else None


def encode_is_invalid(name: str) -> bool:
    return _NAME.fullmatch(name) is None


def list_root(prefix: str) -> str:
    """The folder to list recursively for the keys under ``prefix``: the folders of the
    prefix's segments before its last one (a key equal to the prefix keeps the prefix's last
    segment as its file name, so that one is never a folder to list)."""
    name = encode(prefix)
    folders = max(0, (len(name) - 1) // SEGMENT)
    return "".join(name[i * SEGMENT : (i + 1) * SEGMENT] + "+/" for i in range(folders))
