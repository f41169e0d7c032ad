"""obstore's errors as kvgate's kinds, in one place.

- a missing object (``NotFoundError``, S3's ``NoSuchKey``) is not an error: callers ask
  ``is_missing`` and return a miss; but a missing *bucket* also answers 404, so
  ``NoSuchBucket`` is a ``ConfigError``;
- refused credentials (``PermissionDeniedError``, ``UnauthenticatedError``) are
  ``ConfigError``: retrying cannot help. obstore's messages name the URL and path, never the
  secret (its request headers are not in them);
- ``EntityTooLarge`` and quota errors are ``CapacityError``;
- timeouts (obstore's own or the request's ``asyncio`` bound) are ``Timeout``;
- everything else (connection refused or reset, 5xx, ``SlowDown``) is ``Unavailable``, which
  the tier's retry layer retries and its breaker counts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from obstore import exceptions as ox

from gateway.errors import CapacityError, ConfigError, GatewayError, Timeout, Unavailable

_CREDENTIALS = (
    "403 Forbidden",
    "401 Unauthorized",
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
)
_CAPACITY = ("EntityTooLarge", "QuotaExceeded", "InsufficientStorage", "StorageFull")
_TIMED_OUT = ("timed out", "operation timed out", "TimedOut")


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def is_missing(exc: BaseException) -> bool:
    """An object that is not there (and not a bucket that is not there)."""
    return isinstance(exc, FileNotFoundError | ox.NotFoundError) and "NoSuchBucket" not in str(exc)


@contextlib.contextmanager
def obstore_errors(where: str, bucket: str, timeout: float) -> Iterator[None]:
    try:
        yield
    except TimeoutError as exc:
        raise Timeout(f"{where}: no answer within {timeout:g} s") from exc
    except (FileNotFoundError, ox.BaseError) as exc:  # a missing object was asked about first
        raise mapped(exc, where, bucket) from None


def mapped(exc: BaseException, where: str, bucket: str) -> GatewayError:
    # Listing errors come as GenericError whatever the status: the text says which it was.
    text = str(exc)
    if "NoSuchBucket" in text:
        return ConfigError(f"{where}: bucket {bucket!r} does not exist")
    refused = isinstance(exc, ox.PermissionDeniedError | ox.UnauthenticatedError)
    if refused or any(code in text for code in _CREDENTIALS):
        return ConfigError(
            f"{where}: the credentials were refused for bucket {bucket!r}; check "
            f"access_key_id, secret_access_key, session_token and region ({first_line(exc)})"
        )
    if any(code in text for code in _CAPACITY):
        return CapacityError(f"{where}: {first_line(exc)}")
    if any(word in text for word in _TIMED_OUT):
        return Timeout(f"{where}: {first_line(exc)}")
    return Unavailable(f"{where}: {first_line(exc)}")
