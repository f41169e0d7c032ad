"""Raw config input before validation: YAML files read into mappings, and where values came from.

``read_yaml`` and ``as_mapping`` turn a file or a caller's object into a ``dict`` with string
keys, with errors that name the source (``KVGATE_CONFIG``, ``LMCACHE_CONFIG_FILE``, ...) and never
quote the file's text, which may hold a password. ``Origins`` records, per location, the
environment variable or LMCache key a value came from, so validation errors can name it.
Shared by ``gateway.config`` and ``gateway.config_lmcache``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from gateway.errors import ConfigError

__all__ = ["Origins", "as_mapping", "read_yaml"]

# Where a value at a location came from, for error messages: ("tiers", 0, "timeout") ->
# "KVGATE_TIERS__0__TIMEOUT" or the LMCache key it was mapped from.
Origins = dict[tuple[str | int, ...], str]


def read_yaml(path: str | os.PathLike[str], what: str) -> dict[str, Any]:
    """The mapping in the YAML file at ``path`` (``{}`` if empty); ``what`` names it in errors."""
    text_path = os.fspath(path)
    if "\n" in text_path:
        raise ConfigError(
            f"{what}: expected a path to a YAML file, got text with a newline; "
            "pass a mapping (for example yaml.safe_load(text)) for inline YAML"
        )
    file = Path(text_path).expanduser()
    if not file.is_file():
        state = "is not a file" if file.exists() else "does not exist"
        raise ConfigError(f"{what}: config file {str(file)!r} {state}")
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{what}: cannot read {str(file)!r}: {exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        # Only the position and the problem: PyYAML's own message quotes the offending line,
        # which may hold a password.
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or "invalid YAML"
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{what}: {str(file)!r} is not valid YAML{where}: {problem}") from None
    if data is None:
        return {}
    return as_mapping(data, f"{what} {str(file)!r}")


def as_mapping(data: Any, what: str) -> dict[str, Any]:
    """``data`` as a ``dict`` if it is a mapping with string keys, else ``ConfigError``."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{what}: the top level must be a mapping, got {type(data).__name__}")
    bad = [repr(k) for k in data if not isinstance(k, str)]
    if bad:
        raise ConfigError(f"{what}: keys must be strings, got {', '.join(bad)}")
    return dict(data)
