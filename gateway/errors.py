"""One error root for kvgate and its few kinds.

A miss is ``None``, never an exception; a failure is an exception, never ``None``. Every error
says whether retrying the same call can succeed (``retryable``), which the retry layer and the
service's status-code map read instead of matching on types.
"""

from __future__ import annotations


class GatewayError(Exception):
    """Root of every error kvgate raises on purpose."""

    retryable: bool = False
    kind: str = "error"


class NotFound(GatewayError):
    """The named thing (a connector scheme, a codec, a tier) does not exist."""

    kind = "not_found"


class Unsupported(GatewayError):
    """The operation or object is not supported by this connector, codec or build."""

    kind = "unsupported"


class ConfigError(GatewayError):
    """The configuration is invalid; the message names the offending keys."""

    kind = "config"


class InvalidKey(GatewayError, ValueError):
    """A key string is malformed (empty, too long, an ``@`` in a model name, ...)."""

    kind = "invalid_key"


class InvalidObject(GatewayError, ValueError):
    """An object's description is out of what every tier can store: a shape whose bytes do not
    fit int64 or do not match the data, too many dimensions, an unknown memory format, a TTL
    that is not a finite positive number of seconds (see ``gateway.object_meta``)."""

    kind = "invalid_object"


class Unavailable(GatewayError):
    """A backend is temporarily unreachable or refused the call; retrying may succeed."""

    kind = "unavailable"
    retryable = True


class Timeout(Unavailable):
    """A call did not finish within its deadline."""

    kind = "timeout"


class CircuitOpen(Unavailable):
    """The tier's circuit breaker is open: calls fail fast until the reset period passes."""

    kind = "circuit_open"


class CorruptObject(GatewayError):
    """Bytes read from a backend are not a valid object (bad magic, checksum or header)."""

    kind = "corrupt"


class OverReadLimit(CorruptObject):
    """An object larger than this reader takes (``read_limit()``, from its store's
    ``max_object_size``): a miss counted as corrupt, but left in the backend, where a store
    with a larger limit (perhaps the one that wrote it) still reads it."""

    kind = "corrupt"


class ForeignObject(CorruptObject):
    """Bytes under a key that kvgate did not write (no frame, or not its value format): a miss
    counted as corrupt, but left in the backend, which may be shared with programs that did
    write them (an LMCache engine's chunk on an lm:// server, say)."""

    kind = "corrupt"


class CorruptRemoved(CorruptObject):
    """Corrupt bytes that the backend has already taken out of the key's place (the disk tier
    moves such a file to quarantine/): counted as corrupt, and not deleted again, since a
    delete now could remove a newer object written there meanwhile."""

    kind = "corrupt"


class KeyUnavailable(CorruptObject):
    """An encrypted object this process holds no key for (a key id it does not know, or no keys
    at all). A miss, counted as corrupt like any object that cannot be verified, but left in
    the backend: a reader that holds the key (another store, or this one after a rotation is
    rolled out) can still read it, so one misconfigured reader cannot wipe a shared cache."""

    kind = "corrupt"


class IncompleteDelete(GatewayError):
    """A delete removed the key from some tiers but failed on another, which may still hold it
    (the store reads the key from that tier no more, and deletes it there again at close).

    Not ``Unavailable``: the store that answers is up, so a client holding it as a tier (a
    ``gateway://`` tier) does not count this toward its circuit breaker."""

    kind = "incomplete_delete"


class CapacityError(GatewayError):
    """The object does not fit: larger than allowed, or the backend is full."""

    kind = "capacity"


class MissingDependency(Unsupported):
    """A connector or codec needs an optional extra that is not installed."""

    kind = "missing_dependency"
