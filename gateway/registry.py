"""Find connectors and codecs through entry points; import them only when used.

Connectors register under ``kvgate.connectors`` (name = URL scheme), codecs under
``kvgate.serde`` (name = codec name). A third-party distribution adds one by declaring an entry
point; no core change. When importing a plugin fails for a missing module, the error says which
extra to install (``pip install kvgate[redis]``), read from the providing distribution's own
extras so plugins get the right hint too.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any
from urllib.parse import urlsplit

from gateway.codec import Codec
from gateway.codec_chain import SEPARATOR, build_chain, stage_names
from gateway.connector import Connector
from gateway.errors import ConfigError, MissingDependency, NotFound

CONNECTOR_GROUP = "kvgate.connectors"
CODEC_GROUP = "kvgate.serde"


@dataclass(frozen=True, slots=True)
class PluginStatus:
    """One registered plugin as ``kvgate connectors`` shows it."""

    name: str
    target: str
    distribution: str
    usable: bool
    problem: str = ""


@functools.cache
def _entry_points(group: str) -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=group)}


def _install_hint(ep: EntryPoint, missing: str | None) -> str:
    dist = ep.dist.name if ep.dist is not None else "kvgate"
    extras = (ep.dist.metadata.get_all("Provides-Extra") or []) if ep.dist is not None else []
    # The extra is named after the scheme (redis) or after the module that serves several
    # schemes (rediss, redis+cluster -> connectors.redis -> redis).
    module = ep.value.partition(":")[0].rsplit(".", 1)[-1]
    extra = next((e for e in (ep.name, module) if e in extras), None)
    what = f"the module {missing!r}" if missing else "a dependency"
    if extra:
        return f"{what} is missing: pip install '{dist}[{extra}]'"
    return f"{what} is missing: install the dependencies of {dist}"


def _load(group: str, name: str, kind: str) -> Any:
    eps = _entry_points(group)
    ep = eps.get(name)
    if ep is None:
        known = ", ".join(sorted(eps)) or "none"
        raise NotFound(f"no {kind} named {name!r} is registered (known: {known})")
    try:
        return ep.load()
    except ModuleNotFoundError as exc:
        own = ep.value.partition(":")[0]
        if exc.name and (own == exc.name or own.startswith(exc.name + ".")):
            raise  # the plugin's own module is missing: a broken install, not a missing extra
        raise MissingDependency(f"{kind} {name!r}: {_install_hint(ep, exc.name)}") from exc


def connector_class(scheme: str) -> Any:
    """The class registered for ``scheme``; a scheme ``family+variant`` that has no entry of
    its own falls back to an entry named ``family+`` (a connector for a whole family of
    schemes, such as ``opendal+`` for ``opendal+webdav``, ``opendal+ftp``, ...)."""
    name = scheme.lower()
    family = name.partition("+")[0] + "+"
    eps = _entry_points(CONNECTOR_GROUP)
    if "+" in name and name not in eps and family in eps:
        name = family
    return _load(CONNECTOR_GROUP, name, "connector")


def codec_class(name: str) -> Any:
    return _load(CODEC_GROUP, name.lower(), "codec")


def scheme_of(url: str) -> str:
    scheme = urlsplit(url).scheme
    if not scheme:
        raise NotFound(f"{url!r} has no scheme (expected e.g. file:///path or redis://host)")
    return scheme.lower()


def connect(url: str, **options: Any) -> Connector:
    """Build the connector for ``url`` with its typed options."""
    conn: Connector = connector_class(scheme_of(url)).from_url(url, **options)
    return conn


def load_codec(name: str, **options: Any) -> Codec:
    """The codec ``name`` built with ``options``; a chain's frame name (``bytesplit+aesgcm``)
    builds the chain of its stages with their defaults (what a reader of any frame needs)."""
    if SEPARATOR in name:
        if options:
            raise ConfigError(
                f"codec chain {name!r}: give each stage's options in a list (build_codec)"
            )
        return build_chain([load_codec(stage) for stage in stage_names(name)])
    codec: Codec = codec_class(name)(**options)
    return codec


def build_codec(
    names: str | Sequence[str], options: Mapping[str, Any] | Sequence[Mapping[str, Any]]
) -> Codec:
    """A tier's codec from its config: one name and its options, or a chain (a list of names
    and a list of as many option mappings, or one empty mapping: no options anywhere)."""
    if isinstance(names, str):
        if not isinstance(options, Mapping):
            raise ConfigError(f"codec {names!r}: codec_options must be a mapping")
        return load_codec(names, **options)
    if isinstance(options, Mapping):
        if options:
            raise ConfigError("a codec chain's codec_options must be a list, one per codec")
        options = [{} for _ in names]
    if len(options) != len(names):
        raise ConfigError(
            f"codec chain {list(names)}: {len(options)} codec_options for {len(names)} codecs"
        )
    return build_chain([load_codec(n, **o) for n, o in zip(names, options, strict=True)])


def _status(group: str, kind: str) -> list[PluginStatus]:
    out = []
    for name, ep in sorted(_entry_points(group).items()):
        dist = ep.dist.name if ep.dist is not None else "?"
        try:
            _load(group, name, kind)
        except MissingDependency as exc:
            out.append(PluginStatus(name, ep.value, dist, False, str(exc)))
        except Exception as exc:  # a broken plugin must not hide the others
            out.append(PluginStatus(name, ep.value, dist, False, f"{type(exc).__name__}: {exc}"))
        else:
            out.append(PluginStatus(name, ep.value, dist, True))
    return out


def connector_status() -> list[PluginStatus]:
    return _status(CONNECTOR_GROUP, "connector")


def codec_status() -> list[PluginStatus]:
    return _status(CODEC_GROUP, "codec")
