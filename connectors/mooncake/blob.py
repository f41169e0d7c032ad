"""How one kvgate object is stored as one Mooncake value: the payload, then a short trailer.

    payload | [0x00] | b"KVG" | trailer length (4 or 5)

Why a trailer at all:

- Mooncake refuses empty values, so an empty object needs at least one stored byte, and a
  1-byte object must still differ from it.
- Overwrites must be atomic. Mooncake's ``upsert`` of a key *with the same size* rewrites the
  old replica in place, and a reader already copying that replica gets a mix of both values
  (measured here: torn 32 MiB and 1 MiB reads). An upsert with a *different* size allocates new
  replicas and retires the old ones, which is atomic for readers. So a put looks at the size
  stored now and picks the trailer length that makes the new stored size differ from it: the
  4-byte trailer normally, the 5-byte one when the 4-byte one would give the same size.

The magic lets a read tell a kvgate value from anything else stored under the key.
"""

from __future__ import annotations

from gateway.errors import CorruptObject

MAGIC = b"KVG"
SHORT = 4
LONG = 5
MAX_TRAILER = LONG
_SHORT_TRAILER = MAGIC + bytes([SHORT])
_LONG_TRAILER = b"\x00" + MAGIC + bytes([LONG])


def trailer_for(payload_len: int, stored_now: int | None) -> bytes:
    """The trailer that gives ``payload_len`` bytes a stored size other than ``stored_now``."""
    if stored_now == payload_len + SHORT:
        return _LONG_TRAILER
    return _SHORT_TRAILER


def payload_length(stored: memoryview, what: str) -> int:
    """The payload's length in a stored value (checks the trailer)."""
    n = stored.nbytes
    if n < SHORT or stored[n - SHORT : n - 1] != MAGIC:
        raise CorruptObject(f"{what}: not a kvgate value (no trailer in {n} bytes)")
    length = stored[n - 1]
    if length not in (SHORT, LONG) or n < length or (length == LONG and stored[n - LONG] != 0):
        raise CorruptObject(f"{what}: bad kvgate trailer in a {n}-byte value")
    return n - length
