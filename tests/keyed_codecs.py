"""Keys and codec specs for tests of keyed codecs (``aesgcm``) and codec chains.

A spec is a codec name or a chain's frame name (``bytesplit+aesgcm``); ``build`` makes the
codec with what a test needs (a key file for every keyed stage) and ``tier_codec`` the tier
config that writes it.
"""

from __future__ import annotations

import atexit
import functools
import os
import tempfile
from pathlib import Path
from typing import Any

from gateway.codec import Codec
from gateway.codec_chain import stage_names
from gateway.registry import build_codec, codec_class

# The key every frame in these tests is stored under, as a tier binds it.
OBJECT_KEY = "tests/object"
# Fixed test keys (never used anywhere else): the shared one, and a second one.
SHARED_KEY = bytes(range(32))
OTHER_KEY = bytes(range(100, 132))


def write_key_file(path: Path, *keys: bytes) -> str:
    path.write_text("".join(k.hex() + "\n" for k in keys))
    path.chmod(0o600)
    return str(path)


@functools.cache
def shared_key_file() -> str:
    fd, path = tempfile.mkstemp(prefix="kvgate-test-key-")
    os.close(fd)
    atexit.register(os.unlink, path)
    return write_key_file(Path(path), SHARED_KEY)


def is_keyed_name(name: str) -> bool:
    return bool(getattr(codec_class(name), "keyed", False))


def stage_options(name: str, key_file: str | None = None) -> dict[str, Any]:
    """What a stage is built with: a key file for a keyed codec, nothing for others."""
    return {"key_file": key_file or shared_key_file()} if is_keyed_name(name) else {}


def build(spec: str, key_file: str | None = None, **options: Any) -> Codec:
    """The codec ``spec`` names; ``options`` go to its first stage."""
    names = stage_names(spec)
    per_stage = [stage_options(n, key_file) for n in names]
    per_stage[0] = {**per_stage[0], **options}
    if len(names) == 1:
        return build_codec(names[0], per_stage[0])
    return build_codec(names, per_stage)


def tier_codec(spec: str, key_file: str | None = None) -> dict[str, Any]:
    """The ``codec`` and ``codec_options`` of a tier that writes ``spec`` frames."""
    names = stage_names(spec)
    if len(names) == 1:
        return {"codec": spec, "codec_options": stage_options(spec, key_file)}
    return {"codec": names, "codec_options": [stage_options(n, key_file) for n in names]}


def reader_codec(writer: str, key_file: str | None = None) -> dict[str, Any]:
    """A tier codec other than ``writer`` that can still read its frames: ``zstd`` (``raw``
    for zstd writers), chained with ``aesgcm`` when the writer has a keyed stage, since a
    store reads every frame but can only decrypt with keys it was given."""
    other = "zstd" if writer != "zstd" else "raw"
    if any(is_keyed_name(n) for n in stage_names(writer)):
        return tier_codec(f"{other}+aesgcm", key_file)
    return {"codec": other}
