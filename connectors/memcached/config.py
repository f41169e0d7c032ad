"""URL and options of the memcached connector, and the sizes derived from them.

URL: ``memcached://host[:port]`` (port 11211; ``memcached://`` alone is 127.0.0.1:11211). The
text protocol has no authentication, so a URL with a user or password is refused rather than
silently ignored; options are keyword arguments, never the query string.

Sizes. memcached refuses an item larger than its ``-I`` limit (1 MiB unless raised), and the
limit counts the item's own header, key and CAS as well as the value: measured on memcached
1.6, the largest value of a 250-byte key under ``-I 1m`` is 309 bytes short of 1 MiB. So:

- ``item_limit`` is the server's ``-I`` (tell the connector; it cannot ask a proxy). Sizes
  are bytes or strings such as ``"64MiB"``; note that ``"64m"`` reads as 64,000,000 bytes,
  a little under memcached's ``-I 64m`` (64 MiB), which is the safe side;
- a part holds at most ``item_limit - ITEM_OVERHEAD`` bytes (``part_size``, default 1 MiB or
  that, whichever is smaller);
- an object's main value also carries the object's key (for the collision check) and a tag, so
  an inline object holds ``item_limit - ITEM_OVERHEAD - head`` at most for its key; with
  ``split=false`` the connector declares ``item_limit - UNSPLIT_RESERVE`` as its
  ``max_object_size``, which every key up to ``UNSPLIT_RESERVE - ITEM_OVERHEAD - 9`` bytes
  fits (longer keys get a CapacityError that says so).

memcached itself refuses to start with ``-I`` above half of ``-m``; a server too small for
what is put in it evicts (reads miss) or, with ``-M``, refuses (``CapacityError``).
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass

from pydantic import ByteSize, Field, field_validator, model_validator

from connectors._options import StrictOptions, split_url
from gateway.config import redact_url
from gateway.errors import ConfigError

KiB = 1 << 10
MiB = 1 << 20
DEFAULT_PORT = 11211
ITEM_OVERHEAD = 1024
"""Bytes of an item that are not its value: memcached's header, a key of up to 250 bytes and
the CAS (measured: at most ~310), with room to spare."""
UNSPLIT_RESERVE = 4 * KiB
"""What ``split=false`` keeps off its declared ``max_object_size``: the item overhead plus a
main value's head (tag, key length and a key of up to ~3 KiB)."""
MIN_PART_SIZE = 4 * KiB
"""The smallest ``part_size``; also what a stored manifest's parts must be at least."""
DEFAULT_INLINE_MAX = 4 * MiB
"""Objects up to this size are one item (when the item limit allows; capped per key)."""
RELATIVE_EXPTIME_MAX = 30 * 24 * 3600
"""memcached reads an exptime above 30 days as an absolute unix time."""

_NAMESPACE = re.compile(r"[\x21-\x7e]{0,160}")  # printable ASCII without space: key-safe


class MemcachedOptions(StrictOptions):
    pool_size: int = Field(default=16, ge=1, le=1024, description="connections, at most")
    stripe_concurrency: int = Field(
        default=4, ge=1, le=1024, description="connections one object's parts use at once"
    )
    # A pipelined batch of parts must not be cut off for being long, a silent server must not
    # hold a call forever: the deadline is re-armed by every reply (see client.py).
    timeout: float = Field(default=30.0, gt=0, description="seconds without a reply")
    connect_timeout: float = Field(default=5.0, gt=0)
    item_limit: ByteSize = Field(default=ByteSize(MiB), ge=16 * KiB, description="server's -I")
    part_size: ByteSize | None = Field(default=None, ge=MIN_PART_SIZE, description="default 1 MiB")
    inline_max: ByteSize | None = Field(default=None, ge=0, description="default 4 MiB")
    split: bool = Field(default=True, description="false: one item per object, or refused")
    max_object_size: ByteSize | None = Field(default=None, gt=0, description="optional cap")
    ttl: float | None = Field(default=None, gt=0, description="server-side expiry, seconds")
    namespace: str = "kvgate:"

    @field_validator("namespace")
    @classmethod
    def _check_namespace(cls, value: str) -> str:
        if not _NAMESPACE.fullmatch(value):
            raise ValueError(
                "must be at most 160 printable ASCII characters without spaces "
                "(it starts every memcached key)"
            )
        return value

    @model_validator(mode="after")
    def _check_sizes(self) -> MemcachedOptions:
        room = self.item_limit - ITEM_OVERHEAD
        if self.part_size is not None and self.part_size > room:
            raise ValueError(
                f"part_size {self.part_size} does not fit item_limit {self.item_limit}: "
                f"a part holds at most item_limit - {ITEM_OVERHEAD} bytes "
                "(memcached's item header and key)"
            )
        if self.inline_max is not None and self.inline_max > room:
            raise ValueError(
                f"inline_max {self.inline_max} does not fit item_limit {self.item_limit} "
                f"(at most item_limit - {ITEM_OVERHEAD})"
            )
        return self

    @property
    def effective_part_size(self) -> int:
        return self.part_size or min(MiB, self.item_limit - ITEM_OVERHEAD)

    @property
    def effective_inline_max(self) -> int:
        if not self.split:
            return self.item_limit  # capped per key by what one item holds
        if self.inline_max is not None:
            return self.inline_max
        # One item streams on one connection in one round trip; up to a few MiB that beats
        # parts (measured: a framed 1 MiB chunk, 1 MiB + 256 bytes, puts and gets about twice
        # as fast inline as in two parts). Larger objects are striped over connections.
        return min(DEFAULT_INLINE_MAX, self.item_limit - ITEM_OVERHEAD)

    @property
    def declared_max_object_size(self) -> int | None:
        """``capabilities.max_object_size``: the cap, and with split=false one item's room."""
        limits: list[int] = [] if self.max_object_size is None else [self.max_object_size]
        if not self.split:
            limits.append(self.item_limit - UNSPLIT_RESERVE)
        return min(limits) if limits else None


@dataclass(frozen=True, slots=True)
class Address:
    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"memcached://{host}:{self.port}"


def parse_url(url: str) -> Address:
    """The server a ``memcached://host[:port]`` URL names."""
    parts = split_url(url, "memcached")
    shown = redact_url(url)
    if "@" in parts.netloc:
        raise ConfigError(
            f"{shown!r}: memcached's text protocol has no authentication; "
            "remove the user and password from the URL"
        )
    if parts.path not in ("", "/"):
        raise ConfigError(f"{shown!r}: memcached:// takes host[:port] and no path")
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError as exc:
        raise ConfigError(f"{shown!r}: bad port ({exc})") from None
    return Address(parts.hostname or "127.0.0.1", port)


def exptime(ttl: float | None, now: float | None = None) -> int:
    """memcached's exptime for ``ttl`` seconds from now: 0 = never; whole seconds, at least
    1; above 30 days an absolute unix time, which is how memcached reads such values."""
    if ttl is None:
        return 0
    seconds = max(1, math.ceil(ttl))
    if seconds <= RELATIVE_EXPTIME_MAX:
        return seconds
    return int(time.time() if now is None else now) + seconds
