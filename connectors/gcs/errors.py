"""The one place where aiohttp's and GCS's errors become kvgate's error kinds.

- 404 on an object is a miss (callers ask ``is_missing``); a missing bucket is found by the
  bucket check at first use and is a ``ConfigError``;
- 401/403 (a wrong or expired credential, missing permissions) are ``ConfigError``;
- 413 is ``CapacityError``; 408 and timeouts are ``Timeout``;
- 412 (a generation precondition), 429, 5xx and a server that is down or cuts a body short are
  ``Unavailable``, which the tier's retry layer retries;
- anything else is a plain ``GatewayError`` with the status.

gcloud-aio-auth puts the response body in its error; only its first line is shown. Requests
carry the credential in a header, never in the URL, so no message holds it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import aiohttp

from gateway.errors import CapacityError, ConfigError, GatewayError, Timeout, Unavailable


def status_of(exc: BaseException) -> int:
    return int(exc.status) if isinstance(exc, aiohttp.ClientResponseError) else 0


def is_missing(exc: BaseException) -> bool:
    return status_of(exc) == 404


def _said(exc: aiohttp.ClientResponseError) -> str:
    first = str(exc.message).splitlines()[0] if exc.message else ""
    return f"{exc.status} {first[:200]}".strip()


def to_gateway_error(exc: Exception, where: str, bucket: str) -> GatewayError:
    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, TimeoutError | aiohttp.ServerTimeoutError):
        return Timeout(f"{where}: GCS did not answer in time ({type(exc).__name__})")
    if isinstance(exc, aiohttp.ClientResponseError):
        status, said = exc.status, _said(exc)
        if status in (401, 403):
            return ConfigError(
                f"{where}: GCS refused the credentials for bucket {bucket!r} ({said}); check "
                "service_file (or GOOGLE_APPLICATION_CREDENTIALS) and the bucket's permissions"
            )
        if status == 404:
            return ConfigError(f"{where}: bucket {bucket!r} or the object vanished ({said})")
        if status == 413:
            return CapacityError(f"{where}: GCS refused the object as too large ({said})")
        if status == 408:
            return Timeout(f"{where}: GCS timed the request out ({said})")
        if status in (412, 429) or status >= 500:
            return Unavailable(f"{where}: GCS is unavailable ({said})")
        return GatewayError(f"{where}: GCS refused the request ({said})")
    if isinstance(exc, aiohttp.ClientError | OSError):
        return Unavailable(f"{where}: GCS is unreachable: {type(exc).__name__}: {exc}")
    if isinstance(exc, ValueError):  # a body that is not the JSON GCS sends
        return Unavailable(f"{where}: GCS sent an answer that is not one ({exc})")
    return GatewayError(f"{where}: unexpected {type(exc).__name__}: {exc}")


@contextlib.contextmanager
def gcs_errors(where: str, bucket: str) -> Iterator[None]:
    """Raise every exception from the block as its kvgate kind."""
    try:
        yield
    except GatewayError:
        raise
    except Exception as exc:  # not BaseException: cancellation passes through untouched
        raise to_gateway_error(exc, where, bucket) from exc
