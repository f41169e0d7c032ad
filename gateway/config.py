"""Typed kvgate configuration: a YAML file, a mapping or defaults, then ``KVGATE_*`` overrides.

Sources, in the order ``load_config`` applies them:

1. The base: an explicit source (a ``StoreConfig``, a mapping, or a YAML file path), else the
   file named by ``KVGATE_CONFIG``, else LMCache's environment (``LMCACHE_CONFIG_FILE`` and
   ``LMCACHE_<KEY>``) when any of it is set, else the embedded defaults. A mapping or file that
   uses LMCache's keys (``local_cpu``, ``max_local_disk_size``, ``remote_url``, ...) is mapped
   onto kvgate's tiers; LMCache keys kvgate has no use for are skipped with one warning. The
   LMCache support (detection, ``load_lmcache_env``, ``map_lmcache_config``) lives in
   ``gateway.config_lmcache``; this module re-exports its public functions.
2. ``KVGATE_*`` environment overrides, except for a ``StoreConfig`` passed in (it is final).
   The rule: ``KVGATE_<FIELD>`` sets a top-level field of ``StoreConfig``; ``__`` descends, so
   ``KVGATE_TIERS__0__TIMEOUT=2`` sets ``tiers[0].timeout`` and
   ``KVGATE_TIERS__1__OPTIONS__DB=3`` sets ``tiers[1].options["db"]``. Names are matched
   lower-cased; list positions are integers and must exist. ``KVGATE_TIERS`` takes a JSON list
   and replaces the tiers, before any nested override applies. Values are strings that pydantic
   converts to the field's type, except that a value starting with ``[`` or ``{`` is JSON and an
   empty value, ``null`` or ``none`` is ``None``. ``KVGATE_CONFIG``, ``KVGATE_DATA_DIR``,
   ``KVGATE_KERNELS``, ``KVGATE_TOKEN`` and ``KVGATE_URL`` are the only ``KVGATE_`` names that
   are not fields; any other unknown one is an error.

Every validation failure is a ``ConfigError`` whose message names each offending key by its
location (``tiers.1.capacty: unknown key``) and, for a value that came from the environment or an
LMCache key, that variable or key.

Secrets (URL passwords, options named like ``password``/``token``/``secret_key``) stay readable
by code as ``tier.url`` and ``tier.options[...]`` but never appear in ``repr``/``str``, in
``redacted()``, in ``dump_config`` or in this module's log lines and error messages.
"""

from __future__ import annotations

import copy
import difflib
import json
import logging
import os
import re
from collections.abc import Iterable, Mapping
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from gateway.config_lmcache import (
    is_lmcache_key,
    lmcache_env_present,
    load_lmcache_env,
    looks_like_lmcache,
    map_lmcache_config,
    map_lmcache_with_origins,
)
from gateway.config_source import Origins, as_mapping, read_yaml
from gateway.errors import ConfigError

__all__ = [
    "EVICTION_POLICIES",
    "BreakerConfig",
    "ByteSize",
    "Config",
    "RetryConfig",
    "StoreConfig",
    "TierConfig",
    "default_data_dir",
    "default_tiers",
    "dump_config",
    "is_secret_key",
    "load_config",
    "load_lmcache_env",
    "map_lmcache_config",
    "parse_size",
    "redact_url",
]

logger = logging.getLogger(__name__)

REDACTED = "***"
EVICTION_POLICIES: tuple[str, ...] = ("lru", "lfu", "fifo", "mru", "s3fifo")

# --------------------------------------------------------------------------------------------
# Sizes


class _SizeError(ConfigError, ValueError):
    # ValueError so that pydantic turns it into a located validation error inside a model;
    # ConfigError so that direct callers of parse_size see kvgate's error kind.
    pass


_SIZE_RE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?)(b?)", re.IGNORECASE)
_UNIT_POWER = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(value: int | float | str) -> int:
    """Bytes from ``4096``, ``"4GiB"``, ``"100GB"``, ``"1.5GiB"``, ``"64k"`` (case-insensitive).

    ``KiB``/``Ki``/``K`` are powers of 1024 and ``KB`` powers of 1000; ``B`` is optional.
    Fractions of a unit round down to whole bytes; a fraction of a byte, a negative size or
    anything else raises ``ConfigError``. A float is accepted only when it is a whole number.
    """
    if isinstance(value, bool):  # bool is an int subclass; True is not a size
        raise _SizeError("expected a size in bytes such as 4096 or '4GiB', got a boolean")
    if isinstance(value, int):
        if value < 0:
            raise _SizeError("a size cannot be negative")
        return value
    if isinstance(value, float):
        if not value.is_integer() or value < 0:
            raise _SizeError("a size must be a non-negative whole number of bytes")
        return int(value)
    if not isinstance(value, str):
        raise _SizeError(f"expected a size such as 4096 or '4GiB', got {type(value).__name__}")
    text = value.strip()
    if text.startswith("-"):
        raise _SizeError(f"size {text!r} is negative")
    match = _SIZE_RE.fullmatch(text)
    if match is None:
        raise _SizeError(
            f"malformed size {text!r}: expected a number with an optional unit "
            "(B, KiB, MiB, GiB, TiB, KB, MB, GB, TB, K, M, G, T)"
        )
    number, unit, binary, _ = match.groups()
    if binary and not unit:
        raise _SizeError(f"malformed size {text!r}: 'i' needs a unit letter (KiB, MiB, ...)")
    power = _UNIT_POWER[unit.lower()]
    # "KB" is decimal; "KiB" and the bare "K" are binary, as in most memory-size settings.
    base = 1000 if (unit and not binary and match.group(4)) else 1024
    try:
        amount = Decimal(number) * (base**power)
    except InvalidOperation as exc:  # pragma: no cover - the regex admits only decimals
        raise _SizeError(f"malformed size {text!r}") from exc
    if power == 0 and amount != amount.to_integral_value():
        raise _SizeError(f"size {text!r} is not a whole number of bytes")
    return int(amount)


def _coerce_size(value: Any) -> int:
    if isinstance(value, int | float | str):
        return parse_size(value)
    raise _SizeError(f"expected a size such as 4096 or '4GiB', got {type(value).__name__}")


ByteSize = Annotated[int, BeforeValidator(_coerce_size)]
"""An ``int`` of bytes that also accepts ``"4GiB"``-style strings (see ``parse_size``)."""

# --------------------------------------------------------------------------------------------
# Secrets

# "token(?!s)" keeps counts such as "recent_tokens" (a KIVI option) readable; anything that
# only looks like a secret is hidden too, since hiding a harmless value costs nothing. Azure's
# connection strings hold the account key, and a SAS is a signed grant ("sig=" in a query).
_SECRET_KEY_RE = re.compile(
    r"password|passwd|secret|credential|api_?key|access_?key|private_?key|token(?!s)"
    r"|account_?key|connection_?string|sas_?token|(?<![a-z])sig(?![a-z])",
    re.IGNORECASE,
)
_QUERY_PARAM_RE = re.compile(r"([?&;])([^=&#;]+)=([^&#;]*)")


def is_secret_key(key: str) -> bool:
    """Whether an option named ``key`` holds a secret (password, token, access key, ...)."""
    return bool(_SECRET_KEY_RE.search(key))


def redact_url(url: str) -> str:
    """``url`` with its password and secret query parameters replaced by ``***``.

    A user part without a password (``redis://tok@host``) is hidden whole: some services put a
    token there, and there is no telling it from a user name.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    end = len(rest)
    for stop in "/?#":
        index = rest.find(stop)
        if index != -1:
            end = min(end, index)
    netloc, tail = rest[:end], rest[end:]
    userinfo, at, host = netloc.rpartition("@")
    if at:
        user, colon, _password = userinfo.partition(":")
        netloc = f"{user}:{REDACTED}@{host}" if colon else f"{REDACTED}@{host}"
    tail = _QUERY_PARAM_RE.sub(
        lambda m: f"{m[1]}{m[2]}={REDACTED}" if is_secret_key(m[2]) else m[0], tail
    )
    return f"{scheme}://{netloc}{tail}"


def _redact(value: Any) -> Any:
    """A copy of ``value`` with secret-named entries and URL passwords replaced by ``***``."""
    if isinstance(value, Mapping):
        return {
            k: (REDACTED if v is not None and is_secret_key(str(k)) else _redact(v))
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [_redact(v) for v in value]
    if isinstance(value, str) and "://" in value:
        return redact_url(value)
    return value


# --------------------------------------------------------------------------------------------
# Models


class _Strict(BaseModel):
    # hide_input_in_errors: a raw ValidationError (from direct construction) must not print a
    # URL with its password. allow_inf_nan: no deadline or timeout is meant to be infinite.
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True, allow_inf_nan=False)


class RetryConfig(_Strict):
    """Retries of one call into a tier: ``attempts`` tries in all, exponential backoff."""

    attempts: int = Field(default=2, ge=1)
    backoff_base: float = Field(default=0.02, ge=0)
    backoff_max: float = Field(default=0.5, ge=0)

    @model_validator(mode="after")
    def _backoff_order(self) -> RetryConfig:
        if self.backoff_max < self.backoff_base:
            raise ValueError("backoff_max must not be smaller than backoff_base")
        return self


class BreakerConfig(_Strict):
    """Circuit breaker: opens after ``failures`` consecutive failures (0 disables it) and lets
    a trial call through after ``reset_after`` seconds."""

    failures: int = Field(default=5, ge=0)
    reset_after: float = Field(default=5.0, gt=0)


_URL_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://")


DEFAULT_EVICTION = "lru"
"""A tier's eviction policy unless its config names another."""


class TierConfig(_Strict):
    """One tier: a connector URL plus capacity, codec and the layers around the connector.

    ``memory://`` may appear anywhere, but only a ``memory://`` tier in the first position is
    the store's in-process L1 (holding decoded objects); elsewhere it is an ordinary tier.
    ``name`` and a ``memory://`` tier's default capacity are filled in by the store.
    ``options`` are the connector's own typed options, validated by the connector.

    ``repr``/``str`` hide the URL password and secret-named options; ``redacted()`` gives the
    same view as a dict. ``url``, ``options`` and ``model_dump()`` keep the real values.
    """

    url: str
    name: str | None = Field(default=None, min_length=1)
    capacity: ByteSize | None = None
    eviction: str = DEFAULT_EVICTION
    # One codec, or a chain applied in order (``[bytesplit, aesgcm]``): then ``codec_options``
    # is a list with one mapping per codec (or left out). See gateway/codec_chain.py.
    codec: str | list[str] = Field(default="raw", min_length=1)
    codec_options: dict[str, Any] | list[dict[str, Any]] = Field(default_factory=dict)
    options: dict[str, Any] = Field(default_factory=dict)
    timeout: float = Field(default=5.0, gt=0)
    retry: RetryConfig = Field(default_factory=RetryConfig)
    breaker: BreakerConfig = Field(default_factory=BreakerConfig)
    concurrency: int = Field(default=16, ge=1)
    queue_size: int = Field(default=64, ge=1)
    workers: int = Field(default=4, ge=1)
    backpressure: Literal["wait", "skip"] = "wait"
    ttl: float | None = Field(default=None, gt=0)

    @field_validator("url")
    @classmethod
    def _check_url(cls, url: str) -> str:
        # The value is not echoed: it may carry a password.
        if not _URL_RE.match(url):
            raise ValueError(
                "expected a URL with a scheme, such as memory://, file:///var/lib/kvgate "
                "or redis://host:6379/0"
            )
        return url

    @field_validator("codec")
    @classmethod
    def _check_codec(cls, value: str | list[str]) -> str | list[str]:
        names = [value] if isinstance(value, str) else value
        for name in names:
            if not name or "+" in name:
                raise ValueError(
                    f"codec name {name!r}: a chain is a list ([bytesplit, aesgcm]), not one name"
                )
        return value[0] if isinstance(value, list) and len(value) == 1 else value

    @model_validator(mode="after")
    def _codec_options_match(self) -> TierConfig:
        options = self.codec_options
        if isinstance(self.codec, str):
            if isinstance(options, list):
                if len(options) != 1:
                    raise ValueError(
                        f"codec_options: {len(options)} mappings for one codec {self.codec!r}"
                    )
                self.codec_options = options[0]  # [zstd] with [{...}] is zstd with {...}
        elif isinstance(options, dict):
            if options:
                raise ValueError("codec_options of a codec chain: a list, one mapping per codec")
        elif len(options) != len(self.codec):
            raise ValueError(
                f"codec_options: {len(options)} mappings for the {len(self.codec)} codecs "
                f"{self.codec}"
            )
        return self

    @field_validator("eviction")
    @classmethod
    def _check_eviction(cls, value: str) -> str:
        policy = value.strip().lower()
        if policy not in EVICTION_POLICIES:
            raise ValueError(
                f"unknown eviction policy {value!r}; expected one of {', '.join(EVICTION_POLICIES)}"
            )
        return policy

    @field_validator("backpressure", mode="before")
    @classmethod
    def _lower_backpressure(cls, value: Any) -> Any:
        return value.strip().lower() if isinstance(value, str) else value

    @property
    def scheme(self) -> str:
        """The URL scheme, lower-cased: the connector's registry name."""
        return self.url.partition("://")[0].lower()

    def redacted(self) -> dict[str, Any]:
        """This tier as plain data, safe to print or log."""
        data: dict[str, Any] = _redact(self.model_dump(mode="json"))
        return data

    def __repr_args__(self) -> Iterable[tuple[str | None, Any]]:
        # pydantic builds __repr__, __str__ and rich's pretty form from these pairs, so
        # redacting here covers all three, and StoreConfig's repr of its tiers as well.
        for name, value in super().__repr_args__():
            if name in ("url", "options", "codec_options"):
                yield name, _redact(value)
            else:
                yield name, value


def default_data_dir(env: Mapping[str, str] | None = None) -> Path:
    """``$KVGATE_DATA_DIR``, else ``$XDG_DATA_HOME/kvgate``, else ``~/.local/share/kvgate``."""
    env = os.environ if env is None else env
    if explicit := env.get("KVGATE_DATA_DIR"):
        return Path(explicit).expanduser().absolute()
    xdg = env.get("XDG_DATA_HOME", "")
    # The XDG spec says a relative XDG_DATA_HOME is invalid and must be ignored.
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "kvgate"
    home = env.get("HOME") or str(Path.home())
    return Path(home) / ".local" / "share" / "kvgate"


def _default_tier_dicts(env: Mapping[str, str] | None) -> list[dict[str, Any]]:
    # The disk tier sits under a memory tier that holds the hot set, so it moves large objects
    # with O_DIRECT: through the page cache its write-behind cost 5x the CPU (13-15 ms against
    # 2.7 ms a 32 MiB file here) and the copies slowed the gets being served meanwhile
    # (benchmarks/lm_bench.py: gets 0.58x lmcache_server's buffered, 0.84x direct).
    return [
        {"url": "memory://", "capacity": parse_size("2GiB"), "eviction": "lru"},
        {
            "url": f"file://{default_data_dir(env)}",
            "capacity": parse_size("20GiB"),
            "options": {"direct_io": True},
        },
    ]


def _truthy(value: Any) -> bool:
    """Whether a connector option is true the way the connector's own (pydantic) options
    read it: an environment override arrives as the string "true", YAML may say 1."""
    try:
        return TypeAdapter(bool).validate_python(value) if value is not None else False
    except ValidationError:
        return False  # the connector will refuse the value itself


def default_tiers(env: Mapping[str, str] | None = None) -> list[TierConfig]:
    """The embedded tiers: a 2 GiB ``memory://`` L1 and a 20 GiB ``file://`` data directory
    with ``direct_io``."""
    return [TierConfig.model_validate(t) for t in _default_tier_dicts(env)]


class StoreConfig(_Strict):
    """The whole store: an ordered, non-empty list of tiers plus store-wide settings.

    ``staging`` is the host buffer pool for in-flight writes and returned objects when there is
    no ``memory://`` L1 tier. ``pin_memory=None`` pins that memory when CUDA is available.
    ``max_object_size`` refuses larger puts (``CapacityError``) and bounds what a stored
    frame may claim on read. ``prefault`` touches the whole pool when the store opens (in a
    worker thread), so puts copy at memcpy speed from the first one instead of paying a page
    fault per 4 KiB. ``huge_pages`` backs the (unpinned) pool with transparent huge pages;
    ``None`` does so when a tier's options ask for ``direct_io``, whose O_DIRECT reads ran 3x
    faster into huge pages here (``gateway.host_memory``). ``write_policy``: ``back`` (a put
    returns once the first tier holds the object; lower tiers are written from queues) or
    ``through`` (every put is durable: it returns once every tier holds the object).
    """

    tiers: list[TierConfig] = Field(default_factory=default_tiers, min_length=1)
    chunk_size: int = Field(default=256, gt=0)
    save_partial_chunks: bool = False
    staging: ByteSize = 256 * 1024**2
    prefetch_deadline: float = Field(default=10.0, gt=0)
    pin_memory: bool | None = None
    prefault: bool = True
    huge_pages: bool | None = None
    max_object_size: ByteSize = Field(default=1 << 30, gt=0)
    write_policy: Literal["back", "through"] = "back"

    @field_validator("write_policy", mode="before")
    @classmethod
    def _lower_write_policy(cls, value: Any) -> Any:
        return value.strip().lower() if isinstance(value, str) else value

    def pool_in_huge_pages(self) -> bool:
        """``huge_pages``, or where it is None, whether some tier uses O_DIRECT."""
        if self.huge_pages is not None:
            return self.huge_pages
        return any(_truthy(tier.options.get("direct_io")) for tier in self.tiers)

    @model_validator(mode="after")
    def _unique_names(self) -> StoreConfig:
        # Tier names label metrics and errors, so two explicit tiers may not share one.
        seen: set[str] = set()
        for tier in self.tiers:
            if tier.name is not None:
                if tier.name in seen:
                    raise ValueError(f"tier name {tier.name!r} is used twice")
                seen.add(tier.name)
        return self

    def redacted(self) -> dict[str, Any]:
        """The whole config as plain data, safe to print or log."""
        data = self.model_dump(mode="json", exclude={"tiers"})
        return {"tiers": [t.redacted() for t in self.tiers], **data}

    def model_dump_yaml(self) -> str:
        """The effective config as YAML, secrets redacted (what ``kvgate config`` prints)."""
        return dump_config(self)


Config = StoreConfig
"""The name ``gateway`` exports; the same class."""


def dump_config(cfg: StoreConfig) -> str:
    """``cfg`` as YAML with secrets redacted."""
    return yaml.safe_dump(cfg.redacted(), sort_keys=False, default_flow_style=False)


# --------------------------------------------------------------------------------------------
# Validation errors


def _model_at(loc: tuple[str | int, ...]) -> type[BaseModel] | None:
    """The model class whose field ``loc`` points into, for "did you mean" hints."""
    model: type[BaseModel] = StoreConfig
    for seg in loc:
        if isinstance(seg, int):
            continue
        field = model.model_fields.get(seg)
        if field is None:
            return None
        ann = field.annotation
        if get_origin(ann) is list:
            ann = get_args(ann)[0]
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


def _describe(err: Mapping[str, Any]) -> str:
    loc: tuple[str | int, ...] = tuple(err["loc"])
    kind = err["type"]
    if kind == "extra_forbidden":
        model = _model_at(loc[:-1])
        if model is not None and isinstance(loc[-1], str):
            close = difflib.get_close_matches(loc[-1], list(model.model_fields), n=1)
            if close:
                return f"unknown key (did you mean {close[0]!r}?)"
        return "unknown key"
    if kind == "missing":
        return "required key missing"
    return str(err["msg"]).removeprefix("Value error, ")


def _config_error(exc: ValidationError, origin: str, origins: Origins) -> ConfigError:
    lines: list[str] = []
    for err in exc.errors(include_url=False, include_input=False):
        loc = tuple(err["loc"])
        where = ".".join(str(p) for p in loc) or "(top level)"
        line = f"{where}: {_describe(err)}"
        for cut in range(len(loc), 0, -1):
            if (source := origins.get(loc[:cut])) is not None:
                line += f" (from {source})"
                break
        if line not in lines:
            lines.append(line)
    return ConfigError(f"invalid kvgate config ({origin}): " + "; ".join(lines))


def _validate(data: Mapping[str, Any], origin: str, origins: Origins) -> StoreConfig:
    try:
        return StoreConfig.model_validate(data)
    except ValidationError as exc:
        # "from None": the ValidationError would print the inputs in a traceback's cause.
        raise _config_error(exc, origin, origins) from None


# --------------------------------------------------------------------------------------------
# KVGATE_* environment

_ENV_PREFIX = "KVGATE_"
# Read elsewhere, not by the config: KVGATE_KERNELS by gpu/dispatch.py (which kernels run),
# KVGATE_TOKEN by `kvgate serve` and the CLI (a bearer token), KVGATE_URL by the CLI.
_NON_FIELD_ENV = frozenset(
    {
        "KVGATE_CONFIG",
        "KVGATE_DATA_DIR",
        "KVGATE_KERNELS",
        "KVGATE_MALLOC_THRESHOLDS",  # read by the kvgate command (gateway.malloc_thresholds)
        "KVGATE_TOKEN",
        "KVGATE_URL",
    }
)
_NULLS = frozenset({"", "null", "none"})


def _env_value(name: str, raw: str, *, json_only: bool) -> Any:
    text = raw.strip()
    if json_only or text[:1] in ("[", "{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            # Position only: the text may hold a password.
            raise ConfigError(
                f"{name}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"
            ) from None
    if text.lower() in _NULLS:
        return None
    return text


def _env_overrides(env: Mapping[str, str]) -> list[tuple[str, tuple[str, ...], Any]]:
    fields = StoreConfig.model_fields
    found: list[tuple[str, tuple[str, ...], Any]] = []
    for name, raw in env.items():
        if not name.startswith(_ENV_PREFIX) or name in _NON_FIELD_ENV:
            continue
        path = tuple(seg.lower() for seg in name.removeprefix(_ENV_PREFIX).split("__"))
        if not all(path):
            raise ConfigError(f"{name}: empty name segment (use a double underscore between keys)")
        if path[0] not in fields:
            known = ", ".join(f"{_ENV_PREFIX}{f.upper()}" for f in fields)
            raise ConfigError(
                f"{name}: unknown kvgate environment variable (names no config field); "
                f"known: {known}, {', '.join(sorted(_NON_FIELD_ENV))}"
            )
        found.append((name, path, _env_value(name, raw, json_only=path == ("tiers",))))
    # Whole values before the nested ones that refine them, so KVGATE_TIERS comes first.
    found.sort(key=lambda item: (len(item[1]), item[0]))
    return found


def _apply_env(data: dict[str, Any], env: Mapping[str, str]) -> tuple[dict[str, Any], Origins]:
    overrides = _env_overrides(env)
    origins: Origins = {}
    if not overrides:
        return data, origins
    data = copy.deepcopy(data)  # never mutate the caller's mapping
    for name, path, value in overrides:
        node: Any = data
        loc: list[str | int] = []
        for depth, seg in enumerate(path):
            last = depth == len(path) - 1
            if isinstance(node, list):
                if not seg.isdigit() or int(seg) >= len(node):
                    raise ConfigError(
                        f"{name}: {seg!r} is not a position in {'.'.join(map(str, loc))} "
                        f"(0 to {len(node) - 1})"
                    )
                index = int(seg)
                if isinstance(node[index], BaseModel):  # a TierConfig inside a passed mapping
                    node[index] = node[index].model_dump()
                loc.append(index)
                if last:
                    node[index] = value
                else:
                    node = node[index]
            elif isinstance(node, dict):
                loc.append(seg)
                if last:
                    node[seg] = value
                else:
                    child = node.get(seg)
                    if child is None:
                        # Created here, so an error about it (a scalar field given nested
                        # keys, say) is this variable's doing.
                        child = node[seg] = {}
                        origins.setdefault(tuple(loc), name)
                    elif isinstance(child, BaseModel):
                        child = node[seg] = child.model_dump()
                    node = child
            else:
                raise ConfigError(f"{name}: {'.'.join(map(str, loc))} has no nested keys")
        origins[tuple(loc)] = name
    return data, origins


# --------------------------------------------------------------------------------------------
# Loading


def load_config(
    source: StoreConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
) -> StoreConfig:
    """The effective ``StoreConfig`` from ``source`` and the environment (see module docs).

    ``env`` defaults to ``os.environ``. Raises ``ConfigError`` naming every offending key.
    """
    env = os.environ if env is None else env
    if isinstance(source, StoreConfig):
        return source
    force_lmcache = False
    if source is None:
        if path := env.get("KVGATE_CONFIG"):
            data, origin = read_yaml(path, "KVGATE_CONFIG"), f"KVGATE_CONFIG file {path!r}"
        elif lmcache_env_present(env):
            data, origin, force_lmcache = load_lmcache_env(env), "LMCACHE_* environment", True
        else:
            data, origin = {}, "defaults"
    elif isinstance(source, Mapping):
        data, origin = as_mapping(source, "config mapping"), "mapping"
    elif isinstance(source, str | os.PathLike):
        data, origin = read_yaml(source, "config"), f"file {os.fspath(source)!r}"
    else:
        raise ConfigError(
            "config source must be a StoreConfig, a mapping, a path to a YAML file or None, "
            f"got {type(source).__name__}"
        )

    origins: Origins = {}
    if force_lmcache or looks_like_lmcache(data):
        own = sorted(k for k in data if k in StoreConfig.model_fields and k != "chunk_size")
        if own:
            lm_keys = sorted(k for k in data if k != "chunk_size" and is_lmcache_key(k))
            raise ConfigError(
                f"{origin}: mixes kvgate keys ({', '.join(own)}) with LMCache keys "
                f"({', '.join(lm_keys)}); use one format"
            )
        data, origins = map_lmcache_with_origins(data)
        origin = f"{origin}, LMCache format"
    elif "tiers" not in data:
        data = {**data, "tiers": _default_tier_dicts(env)}

    data, env_origins = _apply_env(data, env)
    origins.update(env_origins)
    cfg = _validate(data, origin, origins)
    logger.debug("kvgate config from %s: %r", origin, cfg)  # repr is redacted
    return cfg
