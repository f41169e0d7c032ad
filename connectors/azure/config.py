"""Options of ``azure://account/container/prefix``, its URL, and where its credential comes from.

The URL names the storage account, the container and a name prefix; everything else is a typed
option. The credential is, first found wins: the ``connection_string``, ``account_key`` or
``sas_token`` option, then ``AZURE_STORAGE_CONNECTION_STRING``, ``AZURE_STORAGE_KEY`` (or
``AZURE_STORAGE_ACCOUNT_KEY``) and ``AZURE_STORAGE_SAS_TOKEN`` in the environment — the
variables Azure's own tools read. All three are ``SecretStr``: never in a repr, a log line or
an error message.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from connectors._options import StrictOptions, parse_options, split_url
from gateway.config import ByteSize, redact_url
from gateway.errors import ConfigError

MiB = 1 << 20
MAX_BLOCKS = 50_000
"""Azure's limit of committed blocks per blob."""
MAX_BLOCK_SIZE = 4000 * MiB
MAX_PREFIX = 512

_ACCOUNT_RE = re.compile(r"^[a-z0-9]{3,24}$")
# Azure: 3-63 lowercase letters, digits and single hyphens, starting with a letter or digit.
_CONTAINER_RE = re.compile(r"^(?=.{3,63}$)[a-z0-9](?:[a-z0-9]|-(?!-))*[a-z0-9]$")

ENV_CONNECTION_STRING = "AZURE_STORAGE_CONNECTION_STRING"
ENV_ACCOUNT_KEYS = ("AZURE_STORAGE_KEY", "AZURE_STORAGE_ACCOUNT_KEY")
ENV_SAS_TOKEN = "AZURE_STORAGE_SAS_TOKEN"  # noqa: S105 (a variable name)


class AzureOptions(StrictOptions):
    endpoint: str | None = Field(
        default=None,
        description="the account's blob endpoint, http(s)://host[:port][/account] (azurite: "
        "http://127.0.0.1:10000/devstoreaccount1); None = https://ACCOUNT.blob.core.windows.net",
    )
    connection_string: SecretStr | None = None
    account_key: SecretStr | None = None
    sas_token: SecretStr | None = None
    connect_timeout: float = Field(default=5.0, gt=0)
    read_timeout: float = Field(
        default=30.0, gt=0, description="longest silence on a socket while a request runs"
    )
    request_timeout: float = Field(
        default=120.0,
        gt=0,
        description="one whole call: a put under put_threshold, one staged block, the commit, "
        "or a whole get (all its ranges)",
    )
    # Objects up to 64 MiB (a 32 MiB chunk and its frame header, too) move in one request each
    # way: on a local server more streams per object only add overhead at that size.
    put_threshold: ByteSize = Field(
        default=64 * MiB, gt=0, description="larger objects go as staged blocks"
    )
    block_size: ByteSize = Field(default=8 * MiB, gt=0, le=MAX_BLOCK_SIZE)
    ranged_get_threshold: ByteSize = Field(
        default=64 * MiB, gt=0, description="the first GET's size; the rest comes in ranges"
    )
    range_size: ByteSize = Field(default=8 * MiB, gt=0)
    max_concurrency: int = Field(
        default=8, ge=1, description="blocks staged or ranges read in parallel, per object"
    )
    create_container: bool = False
    batch_concurrency: int = Field(default=16, ge=1)
    api_version: str | None = Field(
        default=None, description="the REST API version to speak; None = the SDK's newest"
    )

    @field_validator("endpoint")
    @classmethod
    def _check_endpoint(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^https?://[^/?#]+(/[A-Za-z0-9]+)?/?$", value):
            raise ValueError("expected http(s)://host[:port][/account] with no query")
        return value.rstrip("/") if value is not None else None

    @model_validator(mode="after")
    def _one_credential(self) -> AzureOptions:
        given = [self.connection_string, self.account_key, self.sas_token]
        if sum(v is not None for v in given) > 1:
            raise ValueError("give one of connection_string, account_key and sas_token")
        return self


@dataclass(frozen=True, slots=True)
class Location:
    account: str
    container: str
    prefix: str
    """"" or a path ending in "/"."""


@dataclass(frozen=True, slots=True)
class Credential:
    """What the client is built from: a connection string, or an account URL and a secret."""

    kind: Literal["connection_string", "account_key", "sas_token"]
    secret: SecretStr
    where: str
    """The option or variable it came from, for messages (never the value)."""


def parse_url(url: str) -> Location:
    parts = split_url(url, "azure")
    if parts.username is not None or parts.password is not None:
        raise ConfigError(
            f"{redact_url(url)!r}: credentials go in the connection_string, account_key or "
            "sas_token options (or the AZURE_STORAGE_* environment), not in the URL"
        )
    account = parts.netloc
    if not _ACCOUNT_RE.match(account):
        raise ConfigError(f"{url!r}: expected azure://account/container/prefix, account [a-z0-9]")
    container, _, rest = parts.path.lstrip("/").partition("/")
    if not _CONTAINER_RE.match(container):
        raise ConfigError(f"{url!r}: {container!r} is not a valid container name")
    prefix = rest.strip("/")
    if "//" in prefix or any(p in (".", "..") for p in prefix.split("/") if prefix):
        raise ConfigError(f"{url!r}: the prefix must not hold empty, '.' or '..' segments")
    if len(prefix.encode()) > MAX_PREFIX:
        raise ConfigError(f"{url!r}: the prefix is limited to {MAX_PREFIX} bytes")
    return Location(account, container, f"{prefix}/" if prefix else "")


def parse(url: str, options: Mapping[str, Any]) -> tuple[Location, AzureOptions]:
    return parse_url(url), parse_options(AzureOptions, url, options)


def credential(opts: AzureOptions, env: Mapping[str, str] | None = None) -> Credential:
    """The credential to use (options first, then the environment); ConfigError if none."""
    env = os.environ if env is None else env
    if opts.connection_string is not None:
        return Credential("connection_string", opts.connection_string, "connection_string")
    if opts.account_key is not None:
        return Credential("account_key", opts.account_key, "account_key")
    if opts.sas_token is not None:
        return Credential("sas_token", opts.sas_token, "sas_token")
    if env.get(ENV_CONNECTION_STRING):
        return Credential(
            "connection_string", SecretStr(env[ENV_CONNECTION_STRING]), ENV_CONNECTION_STRING
        )
    for name in ENV_ACCOUNT_KEYS:
        if env.get(name):
            return Credential("account_key", SecretStr(env[name]), name)
    if env.get(ENV_SAS_TOKEN):
        return Credential("sas_token", SecretStr(env[ENV_SAS_TOKEN]), ENV_SAS_TOKEN)
    raise ConfigError(
        "no Azure credential: set connection_string, account_key or sas_token, or "
        f"{ENV_CONNECTION_STRING}, {ENV_ACCOUNT_KEYS[0]} or {ENV_SAS_TOKEN}"
    )


def connection_string_account(connection_string: str) -> str | None:
    """The AccountName of a connection string (None if it has none)."""
    for field in connection_string.split(";"):
        name, _, value = field.partition("=")
        if name.strip().lower() == "accountname":
            return value.strip()
    return None


def account_url(location: Location, opts: AzureOptions) -> str:
    return opts.endpoint or f"https://{location.account}.blob.core.windows.net"
