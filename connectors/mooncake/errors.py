"""Mooncake's return codes, and the one place they become kvgate errors.

The Python API returns ``int`` codes (``mooncake-store/include/types.h``'s ``ErrorCode``) rather
than raising. Codes the operations handle themselves (a miss, a replica still being written, a
lease) never reach ``error_for``; every other negative code does, and the message carries the
code and its name. The mapping:

- NO_AVAILABLE_HANDLE (-200): no segment has room -> ``CapacityError`` (the store is full,
  the object is larger than any segment, or the processes holding segments are all gone).
- RPC, transfer, segment, HA and "not available in this state" codes -> ``Unavailable`` (the
  master or the process holding the segment is down or unreachable: retrying may help).
- LEASE_EXPIRED (-707) after the retries, OBJECT_HAS_LEASE (-706) past the deadline ->
  ``Unavailable``.
- anything else -> ``GatewayError`` (a bug or a misconfiguration: retrying does not help).
"""

from __future__ import annotations

from gateway.errors import CapacityError, GatewayError, Unavailable

OK = 0
INTERNAL_ERROR = -1
NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600
REPLICA_IS_NOT_READY = -703
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
LEASE_EXPIRED = -707
OBJECT_HAS_REPLICATION_TASK = -708
OBJECT_REPLICA_BUSY = -714
TRANSFER_FAIL = -800
RPC_FAIL = -900

NAMES: dict[int, str] = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -100: "SHARD_INDEX_OUT_OF_RANGE",
    -101: "SEGMENT_NOT_FOUND",
    -102: "SEGMENT_ALREADY_EXISTS",
    -103: "CLIENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE",
    -300: "INVALID_VERSION",
    -400: "INVALID_KEY",
    -500: "WRITE_FAIL",
    -600: "INVALID_PARAMS",
    -601: "ILLEGAL_CLIENT",
    -700: "INVALID_WRITE",
    -701: "INVALID_READ",
    -702: "INVALID_REPLICA",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -708: "OBJECT_HAS_REPLICATION_TASK",
    -714: "OBJECT_REPLICA_BUSY",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL",
    -901: "RPC_TIMEOUT",
    -1010: "UNAVAILABLE_IN_CURRENT_STATUS",
    -1011: "UNAVAILABLE_IN_CURRENT_MODE",
}

# Codes that say "not now": a peer is down, a segment went away, the master is elsewhere.
_TEMPORARY = {-1, -101, -103, -601, -703, -706, -707, -708, -712, -714, -800, -801, -1010}


def describe(code: int) -> str:
    return f"{code} ({NAMES.get(code, 'unknown code')})"


def error_for(code: int, what: str) -> GatewayError:
    """The kvgate error for Mooncake's ``code``, returned by the operation ``what``."""
    if code == NO_AVAILABLE_HANDLE:
        return CapacityError(
            f"{what}: the Mooncake store is full: no mounted segment has room for the object, "
            f"even after eviction, or no segment is mounted at all (code {describe(code)})"
        )
    message = f"{what}: Mooncake returned {describe(code)}"
    if code in _TEMPORARY or -999 <= code <= -900 or -1099 <= code <= -1000:
        return Unavailable(message)
    return GatewayError(message)


def check(code: int, what: str) -> None:
    """Raise ``error_for(code)`` unless ``code`` is 0 or a positive count."""
    if code < 0:
        raise error_for(code, what)
