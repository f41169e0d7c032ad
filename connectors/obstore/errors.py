"""obstore's errors as kvgate's kinds, in one place.

obstore's messages hold the request's URL, so the object's name, and a key's letters pass
through its escape unchanged: a key named ``NoSuchBucket`` must not read as that error. Only
what a key cannot spell is trusted: S3's ``<Code>…</Code>`` (a name never holds ``<``), the
HTTP status after ``status code:`` and words with spaces (names never hold spaces), and the
exception's type.

- a missing object (404, S3's ``NoSuchKey``) is not an error: callers ask ``is_missing`` and
  return a miss; but ``NoSuchBucket`` is a ``ConfigError``. A HEAD's 404 has no body to tell
  the two apart: ``exists`` of a bucket deleted after the connector's first check is a miss;
- refused credentials (401, 403, ``PermissionDeniedError``, ``UnauthenticatedError``) and a
  client obstore cannot build are ``ConfigError``: retrying cannot help. Messages are cut to
  their first line, which names the URL, never the secret;
- ``EntityTooLarge`` and quota errors are ``CapacityError``;
- timeouts (obstore's own or the call's ``asyncio`` bound) are ``Timeout``;
- a connection refused or reset, 5xx, 408 and 429 (``SlowDown``) are ``Unavailable``, which
  the tier's retry layer retries and its breaker counts;
- any other refusal (another 4xx, an invalid path) is a plain ``GatewayError``.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

from obstore import exceptions as ox

from gateway.errors import CapacityError, ConfigError, GatewayError, Timeout, Unavailable

_CODE_RE = re.compile(r"<Code>([A-Za-z0-9.]+)</Code>")
_STATUS_RE = re.compile(r"status code: (\d{3})")
_CREDENTIALS = frozenset(
    {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"}
)
_CAPACITY = frozenset({"EntityTooLarge", "QuotaExceeded", "InsufficientStorage", "StorageFull"})
_TEMPORARY_STATUS = frozenset({408, 429})


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def s3_code(exc: BaseException) -> str | None:
    found = _CODE_RE.search(str(exc))
    return found.group(1) if found else None


def http_status(exc: BaseException) -> int | None:
    found = _STATUS_RE.search(str(exc))
    return int(found.group(1)) if found else None


def is_missing(exc: BaseException) -> bool:
    """An object that is not there (and not a bucket that is not there)."""
    if not isinstance(exc, FileNotFoundError | ox.NotFoundError):
        return False
    return s3_code(exc) != "NoSuchBucket"


@contextlib.contextmanager
def obstore_errors(where: str, bucket: str, timeout: float) -> Iterator[None]:
    try:
        yield
    except TimeoutError as exc:
        raise Timeout(f"{where}: no answer within {timeout:g} s") from exc
    except (FileNotFoundError, ox.BaseError) as exc:  # a missing object was asked about first
        raise mapped(exc, where, bucket) from None


def mapped(exc: BaseException, where: str, bucket: str) -> GatewayError:
    code, status, text = s3_code(exc), http_status(exc), str(exc)
    line = first_line(exc)
    if code == "NoSuchBucket":
        return ConfigError(f"{where}: bucket {bucket!r} does not exist")
    refused = isinstance(exc, ox.PermissionDeniedError | ox.UnauthenticatedError)
    if refused or status in (401, 403) or code in _CREDENTIALS:
        return ConfigError(
            f"{where}: the credentials were refused for bucket {bucket!r}; check "
            f"access_key_id, secret_access_key, session_token and region ({line})"
        )
    if code in _CAPACITY or status == 413:
        return CapacityError(f"{where}: {line}")
    if "timed out" in text:
        return Timeout(f"{where}: {line}")
    if isinstance(exc, ox.InvalidPathError | ox.NotSupportedError):
        return GatewayError(f"{where}: {line}")
    if "builder error" in text or isinstance(exc, ox.UnknownConfigurationKeyError):
        return ConfigError(f"{where}: obstore could not build the request ({line})")
    if status is None or status >= 500 or status in _TEMPORARY_STATUS:
        return Unavailable(f"{where}: {line}")  # no answer, or the server is down or busy
    return GatewayError(f"{where}: {line}")
