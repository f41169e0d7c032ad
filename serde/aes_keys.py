"""The ``aesgcm`` codec's keys: read from a file or an environment variable, never the config.

Format (the file, or the variable's value): one key per line (in a variable, commas or spaces
separate keys as well), each 16, 24 or 32 bytes written as hex (``openssl rand -hex 32``) or as
``base64:`` followed by standard base64. Blank lines and lines starting with ``#`` are skipped.
The first key encrypts; every key decrypts (rotation: put the new key first, keep the old ones
after it until nothing written with them is wanted).

A key's id is the first 8 bytes of SHA-256 over a label and the key, in hex: written in every
frame so that a reader picks the right key, and safe to show (a 128-bit or larger random key
cannot be found from it). Key bytes never reach a log line, an error message or a repr.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from gateway.errors import ConfigError

log = logging.getLogger("kvgate.serde.aesgcm")

KEY_SIZES = (16, 24, 32)
_ID_LABEL = b"kvgate aesgcm key id\x00"
_SEPARATORS = re.compile(r"[\s,]+")
_B64_PREFIX = "base64:"


@dataclass(frozen=True, slots=True)
class KeyRing:
    """Keys by id, in order: ``first`` encrypts, all decrypt. Its repr shows ids only."""

    ids: tuple[str, ...]
    _keys: dict[str, bytes] = field(repr=False)

    @property
    def first(self) -> str:
        return self.ids[0]

    def key(self, kid: str) -> bytes | None:
        return self._keys.get(kid)

    def __repr__(self) -> str:
        return f"KeyRing(ids={list(self.ids)})"


def key_id(key: bytes) -> str:
    return hashlib.sha256(_ID_LABEL + key).digest()[:8].hex()


def _parse_one(token: str, where: str, position: int) -> bytes:
    # Messages name the source and the position, never the text: it is key material.
    what = f"{where}: key {position}"
    try:
        if token.lower().startswith(_B64_PREFIX):
            key = base64.b64decode(token[len(_B64_PREFIX) :], validate=True)
        else:
            key = bytes.fromhex(token)
    except (ValueError, binascii.Error):
        raise ConfigError(
            f"{what} is neither hex nor 'base64:'-prefixed base64 (one key per line)"
        ) from None
    if len(key) not in KEY_SIZES:
        raise ConfigError(f"{what} is {len(key)} bytes; AES-GCM keys are 16, 24 or 32 bytes")
    return key


def parse_keys(text: str, where: str, *, one_per_line: bool) -> KeyRing:
    """The keys in ``text`` (see the module docstring); ``where`` names the source in errors."""
    tokens: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        tokens += [line] if one_per_line else [t for t in _SEPARATORS.split(line) if t]
    if not tokens:
        raise ConfigError(f"{where} holds no key")
    keys: dict[str, bytes] = {}
    for position, token in enumerate(tokens, 1):
        key = _parse_one(token, where, position)
        kid = key_id(key)
        if kid in keys:
            raise ConfigError(f"{where}: key {position} is the same as an earlier one ({kid})")
        keys[kid] = key
    return KeyRing(tuple(keys), keys)


def read_key_file(path: str) -> KeyRing:
    where = f"aesgcm key_file {path!r}"
    try:
        file = Path(path).expanduser()
        mode = file.stat().st_mode
        text = file.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: cannot read it ({type(exc).__name__})") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        # As ssh does for its keys, but a warning: some deployments mount secrets 0644.
        log.warning("%s can be read by other users (mode %o)", where, stat.S_IMODE(mode))
    return parse_keys(text, where, one_per_line=True)


def read_key_env(name: str) -> KeyRing:
    where = f"aesgcm key_env {name!r}"
    text = os.environ.get(name)
    if text is None:
        raise ConfigError(f"{where}: the environment variable is not set")
    return parse_keys(text, where, one_per_line=False)
