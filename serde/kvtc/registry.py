"""The calibrations this process knows, by hash (one registry for every ``kvtc`` codec).

Codec objects are built from options and decode with no store at hand, so calibrations live
here: the codec that writes registers its own, and a frame naming an unknown hash raises
``MissingSideObject``, whose ``install`` (called by the tier with the bytes it read under the
calibration's key) verifies the SHA-256 and registers it. Registered calibrations are never
replaced: a hash names one content.
"""

from __future__ import annotations

import threading
from pathlib import Path

from gateway.errors import ConfigError, CorruptObject
from gateway.side_objects import MissingSideObject, side_key
from serde.kvtc.calibration import CalibrationError, Loaded, digest, load

KIND = "kvtc-calibration"
_LOCK = threading.Lock()
_KNOWN: dict[str, Loaded] = {}


def register(data: bytes | memoryview, expected: str | None = None) -> Loaded:
    """Validate calibration bytes and keep them; ``expected``: the hash they must have."""
    raw = bytes(data)
    sha = digest(raw)
    if expected is not None and sha != expected:
        raise CorruptObject(f"kvtc calibration {expected[:16]}... has altered bytes")
    with _LOCK:
        known = _KNOWN.get(sha)
    if known is not None:
        return known
    try:
        loaded = load(raw)
    except CalibrationError as exc:
        raise CorruptObject(str(exc)) from None
    with _LOCK:
        return _KNOWN.setdefault(sha, loaded)


def lookup(sha: str) -> Loaded | None:
    with _LOCK:
        return _KNOWN.get(sha)


def require(sha: str) -> Loaded:
    """The calibration named by a frame, or ``MissingSideObject`` (the tier fetches it)."""
    known = lookup(sha)
    if known is not None:
        return known

    def install(data: bytes) -> None:
        register(data, expected=sha)

    raise MissingSideObject(f"kvtc calibration {sha[:16]}... is not loaded", key_of(sha), install)


def key_of(sha: str) -> str:
    return side_key(KIND, sha)


def resolve(option: str) -> Loaded:
    """A codec's ``calibration`` option: a registered hash or a calibration file's path."""
    known = lookup(option)
    if known is not None:
        return known
    path = Path(option)
    if not path.is_file():
        raise ConfigError(f"codec kvtc: calibration {option!r} is neither a loaded hash nor a file")
    try:
        return register(path.read_bytes())
    except CorruptObject as exc:
        raise ConfigError(f"codec kvtc: {path}: {exc}") from None


def forget_all() -> None:
    """Forget every calibration (tests: a fresh process's view)."""
    with _LOCK:
        _KNOWN.clear()
