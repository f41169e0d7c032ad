"""Typed connector options: one strict pydantic model per connector, errors as ConfigError.

Every connector is built by ``from_url(url, **options)``; its options are checked by a small
pydantic model with ``extra="forbid"`` so that a misspelt option fails loudly at start instead of
being ignored. This module turns pydantic's error into a ``ConfigError`` that names each
offending option, and holds the URL checks the connectors share.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar
from urllib.parse import SplitResult, urlsplit

from pydantic import BaseModel, ConfigDict, ValidationError

from gateway.config import redact_url
from gateway.errors import ConfigError

M = TypeVar("M", bound=BaseModel)


class StrictOptions(BaseModel):
    """Base of every connector's options model: unknown options are errors, values frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def parse_options(model: type[M], url: str, options: Mapping[str, Any]) -> M:
    """Validate ``options`` for the connector at ``url``; a ConfigError names each bad one."""
    try:
        return model.model_validate(dict(options))
    except ValidationError as exc:
        problems = "; ".join(
            f"option {'.'.join(str(p) for p in err['loc']) or '?'!r}: {err['msg']}"
            for err in exc.errors()
        )
        raise ConfigError(f"{redact_url(url)}: {problems}") from None


def split_url(url: str, scheme: str) -> SplitResult:
    """``url`` split into parts, after checking its scheme and that it carries no query.

    Options travel as keyword arguments, never in the query string, so that one place (the
    options model) validates them.
    """
    parts = urlsplit(url)
    if parts.scheme.lower() != scheme:
        raise ConfigError(f"{redact_url(url)!r} is not a {scheme}:// URL")
    if parts.query or parts.fragment:
        raise ConfigError(
            f"{redact_url(url)!r}: options go in keyword arguments, "
            "not in the URL's query or fragment"
        )
    return parts
