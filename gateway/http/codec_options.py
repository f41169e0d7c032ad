"""What a client may ask of a codec in ``x-kvgate-codec-options``: nothing that names a file.

The service never reads a file, or an environment variable, that a client names. Two codec
options would: ``aesgcm``'s ``key_file``/``key_env`` (so a keyed codec is never built for a
client at all, ``refuse_keyed``) and ``kvtc``'s ``calibration``, which takes a loaded
calibration's hash or a file's path. A client gives a calibration only by its hash, and only
one this process has or its tiers hold (under the calibration's side key, where a tier coding
with it wrote it, or a client PUT it): anything else is a 400 whose text is the same whatever
the value names on the server's disk, and the codec is built without touching a file, so
nothing blocks the event loop. A client sets only the options a codec class lists in
``client_options`` (the built-ins list their numeric ones and ``kvtc``'s calibration): a
plugin's codec takes none from a client unless it lists them, since only its author knows
which of its options name files.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from gateway.codec_chain import stage_names
from gateway.errors import ConfigError, CorruptObject
from gateway.objects import ObjectData
from gateway.registry import codec_class
from gateway.tiers import offload
from gateway.types import BYTE_KINDS

Fetch = Callable[[str], Awaitable[ObjectData | None]]
"""Reads a key from the store's tiers (``Store.get_stored``)."""

_SHA256 = re.compile(r"[0-9a-f]{64}")  # serde.kvtc.calibration.digest: SHA-256, lowercase hex


def refuse_keyed(name: str) -> None:
    """A keyed codec (``aesgcm``) is never built for a client: its options would make the
    server read a key file or variable of the client's choosing, and a frame it encrypted
    must reach the backend as it is, not decrypted here. Such a frame PUT by a
    ``gateway://`` tier is refused, and the tier then stores it as opaque bytes."""
    for stage in stage_names(name):
        if getattr(codec_class(stage), "keyed", False):
            raise ConfigError(
                f"codec {stage!r} holds keys: this gateway neither encrypts nor decrypts for "
                "clients (encrypt in the client's own tier; its frames are stored as they are)"
            )


def calibration_of(name: str, options: Mapping[str, Any]) -> str | None:
    """The kvtc calibration hash ``options`` name, if any; ``ConfigError`` for a value that
    is not a hash (a path, say), without looking at what it names."""
    value = options.get("calibration")
    # The registry lower-cases the name (``KVTC`` is kvtc); a chain takes no options at all.
    if name.lower() != "kvtc" or value is None:
        return None
    if not isinstance(value, str) or _SHA256.fullmatch(value) is None:
        raise ConfigError(
            "codec kvtc: a client names a calibration by its SHA-256 (64 lowercase hex "
            "digits) only, never by a path"
        )
    return value


def check_client_options(name: str, options: Mapping[str, Any]) -> None:
    """Refuse options that would make building the codec read a file (see the module doc):
    only those the codec class lists in ``client_options`` (none, for a codec that lists
    none: a plugin's options may name files, and only its author can say which do not), and
    a calibration must already be loaded, so that ``kvtc`` finds it by hash."""
    if options:
        if len(stage_names(name)) > 1:
            raise ConfigError(f"codec {name!r}: a chain takes no options from a client")
        allowed: frozenset[str] = getattr(codec_class(name), "client_options", frozenset())
        refused = sorted(set(options) - set(allowed))
        if refused:
            raise ConfigError(
                f"codec {name!r}: a client may not set {', '.join(map(repr, refused))}"
                + (f" (it may set {', '.join(sorted(allowed))})" if allowed else "")
            )
    sha = calibration_of(name, options)
    if sha is None:
        return
    from serde.kvtc import registry  # imported once a client names a calibration, not before

    if registry.lookup(sha) is None:
        raise ConfigError(f"codec kvtc: no calibration {sha} is stored here")


async def load_named(name: str, options: Mapping[str, Any], fetch: Fetch) -> object | None:
    """Load the calibration ``options`` name by hash from the store's tiers, when this process
    does not have it yet (as a tier does for a frame that names one), and return it: the
    caller holds it until its codec is built, since the registry keeps only a few and may drop
    it meanwhile. Nothing is loaded when it is not stored; ``check_client_options`` then
    refuses the options."""
    sha = calibration_of(name, options)
    if sha is None:
        return None
    from serde.kvtc import registry

    known = registry.lookup(sha)
    if known is not None:
        return known
    stored = await fetch(registry.key_of(sha))
    if stored is None or stored.meta.kind not in BYTE_KINDS:
        return None
    try:  # hashing and validating megabytes: off the event loop
        return await offload(stored.meta.nbytes, registry.register, stored.host(), sha, device=True)
    except CorruptObject as exc:
        raise ConfigError(
            f"codec kvtc: the stored calibration {sha} is not usable: {exc}"
        ) from None
