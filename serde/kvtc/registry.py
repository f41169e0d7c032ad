"""The calibrations this process knows, by hash (one registry for every ``kvtc`` codec).

Codec objects are built from options and decode with no store at hand, so calibrations are
found here: the codec that writes registers its own, and a frame naming an unknown hash raises
``MissingSideObject``, whose ``install`` (called by the tier with the bytes it read under the
calibration's key) verifies the SHA-256 and registers it. A hash names one content, so a
calibration that is loaded is never loaded twice.

Hashes come from backend data and from clients (frames, ``x-kvgate-codec-options``), so what
the registry itself keeps is bounded: the most recently used calibrations, at most
``MAX_KEPT`` of them and ``MAX_KEPT_BYTES`` of estimated memory (the one used last is kept
whatever its size). A loaded calibration costs about twice its bytes (the bytes and their
parsed copy) and, once a chunk was coded with it, four times its float16 bases more (the
float32 transforms, ``Loaded.arrays``): about 64 MiB for a SmolLM2 calibration, several
hundred for an 8B model's. One model's calibration, or a few, stay loaded; a client or a
backend naming many does not make the process grow. A calibration the registry no longer
keeps is freed unless something else holds it: a codec instance holds its own (a tier's or a
configured one's ``calibration``: pinned while the codec lives, and found here by hash
meanwhile), and so does a decode in progress. One that was freed is loaded again when a frame
names it, from the tier's side object, as in a fresh process.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from pathlib import Path

from gateway.errors import ConfigError, CorruptObject
from gateway.side_objects import MissingSideObject, side_key
from serde.kvtc.calibration import CalibrationError, Loaded, digest, load

KIND = "kvtc-calibration"
MAX_KEPT = 4  # calibrations the registry keeps loaded for frames that name them
MAX_KEPT_BYTES = 512 << 20  # their estimated memory (``footprint``)

_LOCK = threading.Lock()
# What the registry keeps, least recently used first, with each one's ``footprint``.
_KEPT: OrderedDict[str, tuple[Loaded, int]] = OrderedDict()
# Every calibration loaded here that is still alive (kept, or held by a codec or a decode),
# so that a hash finds the object a codec holds rather than loading a second copy.
_ALIVE: weakref.WeakValueDictionary[str, Loaded] = weakref.WeakValueDictionary()
_kept_bytes = 0  # the footprints in _KEPT


def footprint(loaded: Loaded) -> int:
    """Estimated bytes a loaded calibration holds once used: its bytes, their parsed copy and
    the float32 encode and decode transforms of its float16 bases."""
    return 2 * len(loaded.data) + 4 * loaded.cal.basis_bytes()


def register(data: bytes | memoryview, expected: str | None = None) -> Loaded:
    """Validate calibration bytes and keep them; ``expected``: the hash they must have."""
    raw = bytes(data)
    sha = digest(raw)
    if expected is not None and sha != expected:
        raise CorruptObject(f"kvtc calibration {expected[:16]}... has altered bytes")
    known = lookup(sha)
    if known is not None:
        return known
    try:
        loaded = load(raw)
    except CalibrationError as exc:
        raise CorruptObject(str(exc)) from None
    with _LOCK:
        loaded = _ALIVE.setdefault(sha, loaded)  # another thread's, if it got there first
        _dropped = _keep(sha, loaded)  # freed on return, outside the lock
    return loaded


def lookup(sha: str) -> Loaded | None:
    """The calibration named ``sha``, if it is loaded (it becomes the most recently used)."""
    with _LOCK:
        loaded = _ALIVE.get(sha)
        _dropped = _keep(sha, loaded) if loaded is not None else []
    return loaded


def _keep(sha: str, loaded: Loaded) -> list[Loaded]:
    """Make ``loaded`` the most recently used one and return what no longer fits (called under
    the lock; the caller drops those once it is released)."""
    global _kept_bytes
    if sha in _KEPT:  # the same object: what _KEPT holds is alive
        _KEPT.move_to_end(sha)
        return []
    size = footprint(loaded)
    _KEPT[sha] = (loaded, size)
    _kept_bytes += size
    dropped = []
    while len(_KEPT) > 1 and (len(_KEPT) > MAX_KEPT or _kept_bytes > MAX_KEPT_BYTES):
        _, (old, old_size) = _KEPT.popitem(last=False)
        _kept_bytes -= old_size
        dropped.append(old)
    return dropped


def kept() -> list[str]:
    """The hashes the registry keeps, least recently used first (tests, diagnostics)."""
    with _LOCK:
        return list(_KEPT)


def require(sha: str) -> Loaded:
    """The calibration named by a frame, or ``MissingSideObject`` (the tier fetches it)."""
    known = lookup(sha)
    if known is not None:
        return known
    installed: list[Loaded] = []

    def install(data: bytes) -> None:
        # Held by the exception until the tier has decoded again: calibrations other
        # threads load meanwhile cannot free this one before that decode finds it.
        installed.append(register(data, expected=sha))

    raise MissingSideObject(f"kvtc calibration {sha[:16]}... is not loaded", key_of(sha), install)


def key_of(sha: str) -> str:
    return side_key(KIND, sha)


def resolve(option: str) -> Loaded:
    """A codec's ``calibration`` option: a loaded calibration's hash or a calibration file's
    path. The codec holds what this returns, so it stays loaded while the codec lives."""
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
    global _kept_bytes
    with _LOCK:
        _dropped = list(_KEPT.values())  # freed on return, outside the lock
        _KEPT.clear()
        _ALIVE.clear()
        _kept_bytes = 0
