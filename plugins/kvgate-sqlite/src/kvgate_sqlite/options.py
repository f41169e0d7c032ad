"""The sqlite:// URL and the connector's options.

URL: ``sqlite:///absolute/path/tier.db`` (three slashes: no host). The file is created when
missing; its folder must exist, so a typo cannot create a tree somewhere unexpected. The
tier writes that file and SQLite's ``-wal`` and ``-shm`` files beside it, nothing else.

Options are keyword arguments (the Store passes a tier's ``options``), checked by a strict
model: a misspelt option is a ``ConfigError`` at start, not a silent default.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

from pydantic import BaseModel, ByteSize, ConfigDict, Field, ValidationError

from gateway.errors import ConfigError

MiB = 1 << 20
SQLITE_LENGTH_CAP = 1_000_000_000
"""SQLite's default SQLITE_MAX_LENGTH: no blob (or row) can be longer, whatever is asked."""


class SqliteOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    capacity: ByteSize | None = Field(
        default=None, gt=0, description="bytes of object data the file may hold (None: no cap)"
    )
    max_object_size: ByteSize = Field(
        default=ByteSize(512 * MiB), gt=0, le=SQLITE_LENGTH_CAP, description="largest object"
    )
    readers: int = Field(default=4, ge=1, le=64, description="reader threads (connections)")
    busy_timeout: float = Field(
        default=5.0, gt=0, description="seconds to wait for another process's write lock"
    )
    synchronous: Literal["off", "normal", "full"] = Field(
        default="normal", description="PRAGMA synchronous (normal: safe against a crash)"
    )
    chunk_size: ByteSize = Field(
        default=ByteSize(4 * MiB), ge=4096, description="bytes per blob read or write call"
    )


SQLITE_HEADER = b"SQLite format 3\x00"
"""The first 16 bytes of every SQLite database file."""


def parse_url(url: str) -> Path:
    """The database file a ``sqlite:///path`` URL names (absolute, folder checked)."""
    parts = urlsplit(url)
    if parts.scheme.lower() != "sqlite":
        raise ConfigError(f"{url!r} is not a sqlite:// URL")
    if parts.netloc:
        raise ConfigError(f"{url!r}: sqlite:// takes a path, not a host (sqlite:///abs/path.db)")
    if parts.query or parts.fragment:
        raise ConfigError(f"{url!r}: options go in keyword arguments, not in the URL")
    raw = unquote(parts.path)
    if not raw or raw.endswith("/"):
        raise ConfigError(f"{url!r}: name the database file (sqlite:///abs/path/tier.db)")
    path = Path(raw)
    if not path.is_absolute() or ".." in path.parts:
        raise ConfigError(f"{url!r}: the path must be absolute and without '..'")
    if not path.parent.is_dir():
        raise ConfigError(f"{url!r}: the folder {str(path.parent)!r} does not exist")
    if path.exists() and not path.is_file():
        raise ConfigError(f"{url!r}: {str(path)!r} exists and is not a file")
    if not looks_like_sqlite(path):
        raise ConfigError(f"{url!r}: {str(path)!r} is not a SQLite database; refusing to use it")
    return path


def looks_like_sqlite(path: Path) -> bool:
    """Whether ``path`` is absent, empty, or starts with SQLite's header string.

    Checked when the tier is configured, so that a file of something else is refused at start
    (``kvgate serve`` exits with this message) instead of failing every call later. Reading
    16 bytes of a local file is as quick as the folder checks above.
    """
    try:
        with path.open("rb") as file:
            head = file.read(len(SQLITE_HEADER))
    except FileNotFoundError:
        return True
    except OSError as exc:
        raise ConfigError(f"sqlite: cannot read {str(path)!r}: {exc.strerror}") from None
    return not head or head == SQLITE_HEADER


def parse_options(url: str, options: Mapping[str, Any]) -> SqliteOptions:
    try:
        return SqliteOptions.model_validate(dict(options))
    except ValidationError as exc:
        problems = "; ".join(
            f"option {'.'.join(str(p) for p in err['loc']) or '?'!r}: {err['msg']}"
            for err in exc.errors()
        )
        raise ConfigError(f"{url}: {problems}") from None
