"""LMCache compatibility: detecting, reading and mapping LMCache configs onto kvgate's.

``load_config`` (in ``gateway.config``, which re-exports ``load_lmcache_env`` and
``map_lmcache_config``) uses this module for two things:

* Detection: a mapping or file that uses LMCache's keys (``local_cpu``, ``max_local_disk_size``,
  ``remote_url``, ...; see ``is_lmcache_key``) is LMCache-shaped, and with no other source, a set
  ``LMCACHE_CONFIG_FILE`` or ``LMCACHE_<KEY>`` for a key kvgate maps selects LMCache's
  environment (``lmcache_env_present``).
* Reading and mapping: ``load_lmcache_env`` reads LMCache's config as LMCache does (its YAML
  file, then ``LMCACHE_<KEY>`` overrides) and ``map_lmcache_config`` turns it into kvgate's
  config mapping: ``local_cpu`` a ``memory://`` tier, ``local_disk`` a ``file://`` tier,
  ``remote_url`` a third tier. LMCache keys kvgate has no use for are skipped with one warning
  that names them (never their values, which may be secrets).

Messages are logged under ``gateway.config``, where they were before this module split off.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from gateway.config_source import Origins, read_yaml
from gateway.errors import ConfigError

__all__ = [
    "is_lmcache_key",
    "lmcache_env_present",
    "load_lmcache_env",
    "looks_like_lmcache",
    "map_lmcache_config",
    "map_lmcache_with_origins",
]

# The name of the module these functions came from, so that logging set up for kvgate's
# config keeps covering them.
logger = logging.getLogger("gateway.config")

_LMCACHE_BOOL_KEYS = frozenset({"local_cpu", "save_unfull_chunk"})
_LMCACHE_INT_KEYS = frozenset({"chunk_size", "blocking_timeout_secs"})
_LMCACHE_FLOAT_KEYS = frozenset({"max_local_cpu_size", "max_local_disk_size"})
_LMCACHE_STR_KEYS = frozenset({"local_disk", "remote_url", "remote_serde", "cache_policy"})
# The LMCache keys kvgate maps (chunk_size too, but it is kvgate's own key as well).
_LMCACHE_MAPPED = _LMCACHE_BOOL_KEYS | _LMCACHE_INT_KEYS | _LMCACHE_FLOAT_KEYS | _LMCACHE_STR_KEYS
# Well-known LMCache keys kvgate ignores; they also mark a mapping as LMCache-shaped, so that a
# file holding only, say, use_layerwise still reads as LMCache's rather than as a typo.
# fmt: off
_LMCACHE_OTHER = frozenset({
    "use_layerwise", "save_decode_cache", "enable_blending", "enable_p2p", "enable_controller",
    "enable_pd", "enable_xpyd", "local_cpu_use_hugepages", "reserve_local_cpu_size",
    "local_disk_path_sharding", "pre_caching_hash_algorithm", "extra_config",
    "external_lookup_client", "py_enable_gc", "numa_mode", "enable_async_loading",
    "priority_limit", "lookup_timeout_ms", "min_retrieve_tokens", "storage_plugins",
    "remote_storage_plugins", "runtime_plugin_locations", "audit_actual_remote_url",
    "weka_path", "cufile_buffer_size", "transfer_channel", "retrieve_locations",
    "store_location", "use_gds", "mp_host", "mp_port",
})
_LMCACHE_PREFIXES = (
    "blend_", "p2p_", "pd_", "nixl_", "gds_", "lmcache_", "controller_",
    "internal_api_server_", "maru_",
)
# fmt: on
_LMCACHE_SERDE = {"naive": "raw", "kivi": "kivi", "cachegen": "cachegen"}
_LMCACHE_BLOCKING_TIMEOUT = 10.0  # LMCache's default blocking_timeout_secs
_GIB = 1024**3  # LMCache's "GB" sizes are int(size * 1024**3)
# LMCACHE_* variables that configure LMCache's process rather than its cache.
_LMCACHE_PROCESS_ENV = frozenset({
    "LMCACHE_CONFIG_FILE", "LMCACHE_DISABLE_BANNER", "LMCACHE_LOG_LEVEL",
    "LMCACHE_TRACK_USAGE", "LMCACHE_USE_EXPERIMENTAL",
})  # fmt: skip
_TRUE = frozenset({"true", "1", "yes", "y", "on"})
_FALSE = frozenset({"false", "0", "no", "n", "off"})


def is_lmcache_key(key: str) -> bool:
    return key in _LMCACHE_MAPPED or key in _LMCACHE_OTHER or key.startswith(_LMCACHE_PREFIXES)


def looks_like_lmcache(data: Mapping[str, Any]) -> bool:
    return any(k != "chunk_size" and is_lmcache_key(k) for k in data)


def _lm_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ConfigError(f"LMCache key {key}: expected true or false")


def _lm_gib(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConfigError(f"LMCache key {key}: expected a size in GB (a number)")
    try:
        size = float(value)
    except ValueError:
        raise ConfigError(f"LMCache key {key}: expected a size in GB (a number)") from None
    if not size >= 0 or size == float("inf"):  # also rejects NaN
        raise ConfigError(f"LMCache key {key}: must be a non-negative number of GB")
    return int(size * _GIB)


def _lm_disk_url(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError("LMCache key local_disk: expected a path or a file:// URL")
    # LMCache strips "file://" and keeps the rest as a path, so "file://local_disk/" is the
    # relative directory local_disk/ and "file:///mnt/x/" is /mnt/x/.
    path = value.strip().removeprefix("file://")
    if "," in path:
        raise ConfigError(
            "LMCache key local_disk: several comma-separated paths are not supported; "
            "configure one file:// tier per directory instead"
        )
    return "file://" + os.path.abspath(os.path.expanduser(path))


def map_lmcache_config(lm: Mapping[str, Any]) -> dict[str, Any]:
    """kvgate's config mapping (for ``load_config``) equivalent to an LMCache config.

    ``local_cpu``/``max_local_cpu_size`` become a ``memory://`` tier, ``local_disk``/
    ``max_local_disk_size`` a ``file://`` tier (only when the size is above 0, as in LMCache),
    ``remote_url`` a third tier with ``remote_serde``'s codec and ``blocking_timeout_secs``
    as its timeout. ``cache_policy`` is the eviction of both local tiers, as in LMCache.
    """
    return map_lmcache_with_origins(lm)[0]


def map_lmcache_with_origins(lm: Mapping[str, Any]) -> tuple[dict[str, Any], Origins]:
    """``map_lmcache_config`` plus which LMCache key each value came from (for errors)."""
    ignored = sorted(k for k in lm if k not in _LMCACHE_MAPPED)
    if ignored:
        # Names only: values of keys we do not understand may be secrets.
        logger.warning("ignoring LMCache config keys kvgate does not use: %s", ", ".join(ignored))
    policy = lm.get("cache_policy", "LRU")
    tiers: list[dict[str, Any]] = []
    origins: Origins = {}
    if _lm_bool(lm.get("local_cpu", True), "local_cpu"):
        tiers.append(
            {
                "url": "memory://",
                "capacity": _lm_gib(lm.get("max_local_cpu_size", 5.0), "max_local_cpu_size"),
                "eviction": policy,
            }
        )
        origins[("tiers", 0, "capacity")] = "LMCache key max_local_cpu_size"
        origins[("tiers", 0, "eviction")] = "LMCache key cache_policy"
    if lm.get("local_disk"):
        size = _lm_gib(lm.get("max_local_disk_size", 0.0), "max_local_disk_size")
        if size > 0:
            origins[("tiers", len(tiers), "eviction")] = "LMCache key cache_policy"
            tiers.append(
                {"url": _lm_disk_url(lm["local_disk"]), "capacity": size, "eviction": policy}
            )
        else:
            logger.warning(
                "LMCache key local_disk is set but max_local_disk_size is 0: "
                "no disk tier (LMCache skips its disk backend too)"
            )
    if remote := lm.get("remote_url"):
        serde = str(lm.get("remote_serde") or "naive").strip().lower()
        if serde not in _LMCACHE_SERDE:
            raise ConfigError(
                f"LMCache key remote_serde: unknown serde {serde!r}; "
                f"expected one of {', '.join(_LMCACHE_SERDE)}"
            )
        origins[("tiers", len(tiers), "url")] = "LMCache key remote_url"
        origins[("tiers", len(tiers), "timeout")] = "LMCache key blocking_timeout_secs"
        tiers.append(
            {
                "url": remote,
                "codec": _LMCACHE_SERDE[serde],
                "timeout": lm.get("blocking_timeout_secs", _LMCACHE_BLOCKING_TIMEOUT),
            }
        )
    if not tiers:
        raise ConfigError(
            "LMCache config enables no storage: set local_cpu, local_disk with "
            "max_local_disk_size > 0, or remote_url"
        )
    out: dict[str, Any] = {"tiers": tiers}
    if "chunk_size" in lm:
        out["chunk_size"] = lm["chunk_size"]
    if "save_unfull_chunk" in lm:
        out["save_partial_chunks"] = lm["save_unfull_chunk"]
        origins[("save_partial_chunks",)] = "LMCache key save_unfull_chunk"
    return out, origins


def _lm_env_value(name: str, key: str, raw: str) -> Any:
    text = raw.strip()
    try:
        if key in _LMCACHE_BOOL_KEYS:
            return _lm_bool(text, key)
        if key in _LMCACHE_INT_KEYS:
            return int(text)
        if key in _LMCACHE_FLOAT_KEYS:
            return float(text)
    except (ValueError, ConfigError):
        kind = "true or false" if key in _LMCACHE_BOOL_KEYS else "a number"
        raise ConfigError(f"{name}: expected {kind}") from None
    if key in _LMCACHE_STR_KEYS:
        return raw
    # A key kvgate does not map (it is only listed as ignored): a best-effort typed value.
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return raw


def load_lmcache_env(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """LMCache's config from the environment, as LMCache reads it, with LMCache's key names.

    ``LMCACHE_CONFIG_FILE`` names a YAML file; ``LMCACHE_<KEY>`` variables override its keys
    (``LMCACHE_LOCAL_CPU=true``, ``LMCACHE_MAX_LOCAL_CPU_SIZE=5.0``, ...). Pass the result to
    ``load_config`` or ``map_lmcache_config``.
    """
    env = os.environ if env is None else env
    data: dict[str, Any] = {}
    if file := env.get("LMCACHE_CONFIG_FILE"):
        data.update(read_yaml(file, "LMCACHE_CONFIG_FILE"))
    for name in sorted(env):
        if name.startswith("LMCACHE_") and name not in _LMCACHE_PROCESS_ENV:
            key = name.removeprefix("LMCACHE_").lower()
            if key:
                data[key] = _lm_env_value(name, key, env[name])
    return data


def lmcache_env_present(env: Mapping[str, str]) -> bool:
    # Only cache keys count: LMCACHE_DISABLE_BANNER and the like say nothing about storage.
    return bool(env.get("LMCACHE_CONFIG_FILE")) or any(
        f"LMCACHE_{key.upper()}" in env for key in _LMCACHE_MAPPED
    )
