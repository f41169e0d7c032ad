"""OpenDAL's errors as kvgate's kinds (a miss is handled by the caller, never raised)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import opendal.exceptions as od

from gateway.errors import ConfigError, GatewayError, Timeout, Unavailable, Unsupported

# OpenDAL's exception classes share no base class of their own (each derives from Exception).
OPENDAL_ERRORS: tuple[type[Exception], ...] = tuple(
    cls
    for cls in vars(od).values()
    if isinstance(cls, type) and issubclass(cls, Exception) and cls.__module__ == od.__name__
)


def mapped(exc: Exception, what: str) -> GatewayError:
    # OpenDAL's message starts with the kind and whether it is temporary; its context names
    # the service and path (no credentials).
    text = f"opendal {what}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    if isinstance(exc, od.Unsupported):
        return Unsupported(text)
    if isinstance(exc, od.ConfigInvalid | od.PermissionDenied):
        return ConfigError(text)
    if isinstance(exc, TimeoutError):
        return Timeout(text)
    return Unavailable(text)


@contextlib.contextmanager
def errors_mapped(what: str, timeout: float) -> Iterator[None]:
    try:
        yield
    except TimeoutError as exc:
        raise Timeout(f"opendal {what}: no answer within {timeout:g} s") from exc
    except OPENDAL_ERRORS as exc:
        raise mapped(exc, what) from exc
