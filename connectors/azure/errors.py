"""The one place where azure-core's and Blob Storage's errors become kvgate's error kinds.

- a missing blob (404 ``BlobNotFound``) is not an error: callers ask ``is_missing`` first;
- a missing container is ``ConfigError`` naming it (or ``create_container=True``);
- refused credentials (401/403: a wrong key, an expired or too narrow SAS) are ``ConfigError``;
- ``RequestBodyTooLarge`` and quota errors are ``CapacityError``;
- timeouts (connect, socket read, a whole call) are ``Timeout``;
- the server down or busy (connection refused or reset, a body cut short, 5xx, 503
  ``ServerBusy``) is ``Unavailable``, which the tier's retry layer retries;
- anything else is a plain ``GatewayError`` with the service's error code.

Messages are built here from the status and error code, never from the request: an SDK error's
text can hold the request URL, and with a SAS the URL holds the signature. ``scrub`` removes
the credential and any ``sig=`` from whatever text of the SDK is shown.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import aiohttp
from azure.core import exceptions as az

from gateway.errors import CapacityError, ConfigError, GatewayError, Timeout, Unavailable

_SIG_RE = re.compile(r"(?i)(sig|signature|accountkey)=[^&;\s'\"]*")
_CAPACITY = frozenset({"RequestBodyTooLarge", "BlockCountExceedsLimit", "AccountIsDisabled"})
_CREDENTIALS = frozenset(
    {
        "AuthenticationFailed",
        "AuthorizationFailure",
        "AuthorizationPermissionMismatch",
        "AuthorizationResourceTypeMismatch",
        "InsufficientAccountPermissions",
        "InvalidAuthenticationInfo",
    }
)


def code_of(exc: BaseException) -> str:
    """The service's error code (``BlobNotFound``, ...); "" if none.

    The SDK's public calls parse it into ``error_code``; the REST operation the connector calls
    directly (a Put Blob) leaves it in the response's ``x-ms-error-code`` header.
    """
    code = getattr(exc, "error_code", None)
    if not code:
        response = getattr(exc, "response", None)
        headers = getattr(response, "headers", None) or {}
        code = headers.get("x-ms-error-code")
    code = getattr(code, "value", code)  # the SDK's StorageErrorCode enum, or a plain string
    return str(code) if code else ""


def status_of(exc: BaseException) -> int:
    return int(getattr(exc, "status_code", 0) or 0)


def is_missing(exc: BaseException) -> bool:
    """A miss: the blob does not exist (never a missing container)."""
    if not isinstance(exc, az.ResourceNotFoundError):
        return False
    return code_of(exc) not in ("ContainerNotFound",)


def is_changed(exc: BaseException) -> bool:
    """An ETag condition failed: the blob was overwritten since the read began."""
    return isinstance(exc, az.ResourceModifiedError) or status_of(exc) == 412


def scrub(text: str, secret: str | None) -> str:
    """``text`` without the credential or any URL signature in it."""
    if secret:
        text = text.replace(secret, "***")
    return _SIG_RE.sub(lambda m: f"{m.group(1)}=***", text)


def to_gateway_error(
    exc: Exception, where: str, container: str, secret: str | None = None
) -> GatewayError:
    """The kvgate error for ``exc``, raised by a call made for ``where``."""
    if isinstance(exc, GatewayError):
        return exc
    code, status = code_of(exc), status_of(exc)
    said = f"{status} {code}".strip()
    timed_out = TimeoutError | az.ServiceRequestTimeoutError | az.ServiceResponseTimeoutError
    if isinstance(exc, timed_out):
        return Timeout(f"{where}: Azure did not answer in time ({type(exc).__name__})")
    if code == "ContainerNotFound":
        return ConfigError(
            f"{where}: container {container!r} does not exist (create it, or set "
            "create_container=True)"
        )
    refused = code in _CREDENTIALS or status in (401, 403)
    if isinstance(exc, az.ClientAuthenticationError) or refused:
        return ConfigError(
            f"{where}: Azure refused the credential for container {container!r} ({said}); "
            "check connection_string, account_key or sas_token (or AZURE_STORAGE_*) and the "
            "SAS's permissions and expiry"
        )
    if code in _CAPACITY or status in (413, 507):
        return CapacityError(f"{where}: Azure refused the object as too large ({said})")
    if code == "OperationTimedOut" or status == 408:
        return Timeout(f"{where}: Azure timed the request out ({said})")
    if isinstance(exc, az.ServiceRequestError | az.ServiceResponseError | az.IncompleteReadError):
        detail = scrub(str(exc).splitlines()[0] if str(exc) else type(exc).__name__, secret)
        return Unavailable(f"{where}: Azure is unreachable: {detail}")
    if isinstance(exc, aiohttp.ClientError | OSError):
        return Unavailable(f"{where}: Azure is unreachable: {type(exc).__name__}")
    if status >= 500 or code in ("ServerBusy", "InternalError"):
        return Unavailable(f"{where}: Azure is unavailable ({said})")
    if is_changed(exc):
        return Unavailable(f"{where}: the blob changed during the call ({said})")
    if code == "InvalidBlockList":
        # Another writer's commit of the same blob discarded this one's staged blocks.
        return Unavailable(f"{where}: a concurrent write of the blob won ({said})")
    if isinstance(exc, az.AzureError):
        return GatewayError(f"{where}: Azure refused the request ({said or type(exc).__name__})")
    return GatewayError(f"{where}: unexpected {type(exc).__name__}")


@contextlib.contextmanager
def azure_errors(where: str, container: str, secret: str | None = None) -> Iterator[None]:
    """Raise every exception from the block as its kvgate kind."""
    try:
        yield
    except GatewayError:
        raise
    except Exception as exc:  # not BaseException: cancellation passes through untouched
        # from None: the SDK's exception text can hold the request URL, and a SAS in it.
        raise to_gateway_error(exc, where, container, secret) from None
