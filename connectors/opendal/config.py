"""``opendal+<service>://[/root]``: the URL names an OpenDAL service; options configure it.

The service's own options (``endpoint``, ``bucket``, ``user``, ...) pass straight through to
``opendal.AsyncOperator(service, **options)``, checked against OpenDAL's typed per-service
configs (``opendal.config.<Service>Config``), so a misspelt option fails at start instead of
being ignored as OpenDAL would. The URL's path, if any, is the service's ``root``; the URL has
no host (where a host goes differs per service: ``endpoint`` says it in OpenDAL's own words).

kvgate's own options, next to the service's:

- ``timeout``: seconds each call may take (default 30);
- ``atomic``: how a put becomes atomic (see ``connector.py``): ``rename`` (write a staging
  object, rename it over the key; needs OpenDAL's ``rename`` capability), ``sealed`` (each
  object carries a length and checksum trailer; a reader retries a torn read), ``native``
  (the service's writes are atomic already, such as an object store's PUT). Default: native
  for the services in ``WHOLE_WRITES`` (in-process maps and object stores), else rename where
  the service can, else sealed;
- ``max_object_size``: the largest object, at most what OpenDAL says the service takes.
"""

from __future__ import annotations

import functools
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from connectors._options import split_url
from gateway.config import redact_url
from gateway.errors import ConfigError

PREFIX = "opendal+"
Atomic = Literal["rename", "sealed", "native"]
OWN_OPTIONS = ("timeout", "atomic", "max_object_size")
SECRET = re.compile(r"password|secret|token|key|sas|credential", re.IGNORECASE)
IN_PROCESS = frozenset({"memory", "moka", "mini-moka", "mini_moka", "dashmap"})
WHOLE_WRITES = IN_PROCESS | {"s3", "azblob", "gcs", "oss", "cos", "obs"}
"""Services whose write is visible only whole, once it is closed: an in-process map's insert,
an object store's PUT (and its multipart or block-list or resumable upload, committed last)."""
"""Services whose objects live in this process only (not ``persistent``)."""


@dataclass(frozen=True)
class OpendalSettings:
    service: str
    service_options: dict[str, str]
    timeout: float
    atomic: Atomic | None
    max_object_size: int | None

    def __repr__(self) -> str:
        shown = {k: "***" if SECRET.search(k) else v for k, v in self.service_options.items()}
        return f"OpendalSettings({self.service!r}, {shown})"


@functools.cache
def service_keys() -> dict[str, frozenset[str]]:
    """Every service OpenDAL's typed configs describe, with the option names it takes."""
    import opendal.config as typed

    out: dict[str, frozenset[str]] = {}
    for value in vars(typed).values():
        if not (isinstance(value, type) and value.__name__.endswith("Config")):
            continue
        hints = getattr(value, "__annotations__", {})
        match = re.search(r"Literal\[['\"]([^'\"]+)['\"]\]", str(hints.get("scheme", "")))
        if match:
            out[match.group(1)] = frozenset(hints) - {"scheme"}
    return out


def _as_option(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float | str):
        return str(value)
    raise TypeError(type(value).__name__)


def parse(url: str, options: Mapping[str, Any]) -> OpendalSettings:
    scheme = url.partition(":")[0].lower()
    shown = redact_url(url)
    if not scheme.startswith(PREFIX) or scheme == PREFIX:
        raise ConfigError(f"{shown!r}: expected opendal+<service>://, e.g. opendal+fs:///data")
    service = scheme[len(PREFIX) :]
    parts = split_url(url, scheme)
    if parts.netloc:
        raise ConfigError(
            f"{shown!r}: the URL takes no host; give the service's endpoint (or bucket, ...) "
            "in its options"
        )
    known = service_keys()
    if service not in known:
        raise ConfigError(
            f"{shown!r}: OpenDAL has no service {service!r} in this build "
            f"(it has: {', '.join(sorted(known))})"
        )
    passed: dict[str, str] = {}
    for name, value in options.items():
        if name in OWN_OPTIONS:
            continue
        if name not in known[service]:
            raise ConfigError(
                f"{shown}: option {name!r} is neither kvgate's ({', '.join(OWN_OPTIONS)}) nor "
                f"one of OpenDAL {service}'s ({', '.join(sorted(known[service]))})"
            )
        try:
            passed[name] = _as_option(value)
        except TypeError as exc:
            raise ConfigError(f"{shown}: option {name!r} must be a scalar, not {exc}") from None
    if parts.path not in ("", "/"):
        if "root" in passed:
            raise ConfigError(f"{shown}: the root is given twice (URL path and option)")
        passed["root"] = parts.path
    return OpendalSettings(
        service=service,
        service_options=passed,
        timeout=_positive(shown, "timeout", options.get("timeout", 30.0)),
        atomic=_atomic(shown, options.get("atomic")),
        max_object_size=(
            None
            if options.get("max_object_size") is None
            else int(_positive(shown, "max_object_size", options["max_object_size"]))
        ),
    )


def _positive(shown: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(f"{shown}: option {name!r} must be a positive number, not {value!r}")
    return float(value)


def _atomic(shown: str, value: Any) -> Atomic | None:
    if value is None or value in typing.get_args(Atomic):
        return typing.cast(Atomic | None, value)
    raise ConfigError(f"{shown}: option 'atomic' must be rename, sealed or native, not {value!r}")
