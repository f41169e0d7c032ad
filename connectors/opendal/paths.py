"""Keys to OpenDAL paths and back: any key, no collisions, no traversal, prefixes kept.

A key's UTF-8 bytes are written with ``[A-Za-z0-9_-]`` as they are and every other byte as
``%XX``, so ``/``, ``.``, ``..``, NUL and ``%`` itself can never act as path syntax, and two
keys never share a path. The name is cut into segments of SEGMENT characters (joined by
``/``) so that long keys stay under file-name limits (255 bytes on most filesystems). Both
steps keep prefixes: a key prefix's path is a string prefix of its keys' paths, which is what
listing by prefix relies on. Nothing kvgate writes starts with ``.`` except its staging area.
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
    return "/".join(name[i : i + SEGMENT] for i in range(0, len(name), SEGMENT)) or name


def key_of(path: str) -> str | None:
    """The key stored at ``path``, or None for a path kvgate would not have written."""
    name = path.replace("/", "")
    if not name or name.startswith(".") or encode_is_invalid(name):
        return None
    if segmented(name) != path:
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
    """The folder to list recursively for the keys under ``prefix``: the full segments of the
    prefix's name (every key under the prefix lives below it)."""
    name = encode(prefix)
    full = len(name) // SEGMENT * SEGMENT
    return "".join(name[i : i + SEGMENT] + "/" for i in range(0, full, SEGMENT))
