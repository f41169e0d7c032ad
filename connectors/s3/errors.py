"""The one place where botocore's, aiohttp's and S3's errors become kvgate's error kinds.

- a missing key (``NoSuchKey``, or 404 on a HEAD) is not an error: callers ask ``is_missing``
  first and return a miss;
- refused credentials (``InvalidAccessKeyId``, ``SignatureDoesNotMatch``, ``AccessDenied``,
  403 on a HEAD, ...) and a missing bucket are ``ConfigError``: retrying cannot help. The
  message names the bucket and the options to check, never a secret;
- ``EntityTooLarge`` and quota errors are ``CapacityError``;
- timeouts (connect, socket read, a whole request, S3's ``RequestTimeout``) are ``Timeout``;
- everything that says the server is down or busy (connection refused or reset, a body cut
  short, 5xx, ``SlowDown``) is ``Unavailable``, which the tier's retry layer retries and its
  breaker counts;
- any other S3 error is a plain ``GatewayError`` with S3's code in the message.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import aiohttp
from botocore import exceptions as boto  # type: ignore[import-untyped]

from gateway.errors import CapacityError, ConfigError, GatewayError, Timeout, Unavailable

_MISSING = frozenset({"NoSuchKey", "NotFound", "404"})
_CREDENTIALS = frozenset(
    {
        "403",
        "Forbidden",
        "AccessDenied",
        "AllAccessDisabled",
        "AccountProblem",
        "AuthorizationHeaderMalformed",
        "ExpiredToken",
        "InvalidAccessKeyId",
        "InvalidSecurity",
        "InvalidToken",
        "RequestTimeTooSkewed",
        "SignatureDoesNotMatch",
        "TokenRefreshRequired",
    }
)
_CAPACITY = frozenset({"EntityTooLarge", "QuotaExceeded", "InsufficientStorage", "StorageFull"})
_TEMPORARY = frozenset(
    {
        "InternalError",
        "ServiceUnavailable",
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "NoSuchUpload",  # the upload vanished (server restart, lifecycle rule): put again
        "OperationAborted",
    }
)


def code_of(exc: BaseException) -> str:
    """S3's error code of a ``ClientError`` ("404" for a HEAD, which has no body); "" if none."""
    if isinstance(exc, boto.ClientError):
        return str(_error(exc).get("Code", ""))
    return ""


def _error(exc: boto.ClientError) -> dict[str, Any]:
    error = exc.response.get("Error")
    return error if isinstance(error, dict) else {}


def status_of(exc: BaseException) -> int:
    if isinstance(exc, boto.ClientError):
        meta = exc.response.get("ResponseMetadata") or {}
        return int(meta.get("HTTPStatusCode") or 0)
    return 0


def is_missing(exc: BaseException) -> bool:
    """A miss: the key does not exist (never a missing bucket, which GETs name)."""
    return code_of(exc) in _MISSING


def is_changed(exc: BaseException) -> bool:
    """An ``If-Match`` failed: the object was overwritten since its first range was read."""
    return code_of(exc) == "PreconditionFailed" or status_of(exc) == 412


def to_gateway_error(exc: Exception, where: str, bucket: str) -> GatewayError:
    """The kvgate error for ``exc``, raised by an S3 call made for ``where``."""
    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, boto.ClientError):
        return _client_error(exc, where, bucket)
    if isinstance(exc, boto.ReadTimeoutError | boto.ConnectTimeoutError | TimeoutError):
        return Timeout(f"{where}: S3 did not answer in time ({type(exc).__name__})")
    if isinstance(exc, boto.SSLError):
        return ConfigError(f"{where}: TLS failed ({exc}); check verify_tls and ca_bundle")
    if isinstance(exc, boto.NoCredentialsError | boto.PartialCredentialsError):
        return ConfigError(
            f"{where}: no S3 credentials found: set access_key_id and secret_access_key, or "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
        )
    if isinstance(exc, boto.CredentialRetrievalError):
        return Unavailable(f"{where}: could not fetch S3 credentials: {exc}")
    if isinstance(
        exc,
        boto.ConnectionError
        | boto.HTTPClientError
        | boto.IncompleteReadError
        | aiohttp.ClientError
        | OSError,
    ):
        return Unavailable(f"{where}: S3 is unreachable: {exc}")
    if isinstance(exc, boto.BotoCoreError):
        return GatewayError(f"{where}: {type(exc).__name__}: {exc}")
    return GatewayError(f"{where}: unexpected {type(exc).__name__}: {exc}")


def _client_error(exc: boto.ClientError, where: str, bucket: str) -> GatewayError:
    error = _error(exc)
    code = str(error.get("Code", ""))
    status = status_of(exc)
    said = f"{code or status}: {error.get('Message', '')}".rstrip(": ")
    if code == "NoSuchBucket":
        return ConfigError(
            f"{where}: bucket {bucket!r} does not exist (create it, or set create_bucket=True)"
        )
    if code in _CREDENTIALS or status == 403:
        return ConfigError(
            f"{where}: S3 refused the credentials for bucket {bucket!r} ({said}); check "
            "access_key_id and secret_access_key (or the AWS_* environment) and the bucket's "
            "permissions"
        )
    if code in _CAPACITY or status in (413, 507):
        return CapacityError(f"{where}: S3 refused the object as too large or full ({said})")
    if code == "RequestTimeout" or status == 408:
        return Timeout(f"{where}: S3 timed the request out ({said})")
    if code in _TEMPORARY or status >= 500:
        return Unavailable(f"{where}: S3 is unavailable ({said})")
    return GatewayError(f"{where}: S3 refused the request ({said})")


@contextlib.contextmanager
def s3_errors(where: str, bucket: str) -> Iterator[None]:
    """Raise every exception from the block as its kvgate kind."""
    try:
        yield
    except GatewayError:
        raise
    except Exception as exc:  # not BaseException: cancellation passes through untouched
        raise to_gateway_error(exc, where, bucket) from exc
