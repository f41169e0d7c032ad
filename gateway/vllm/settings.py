"""What ``kv_connector_extra_config`` may say to kvgate's vLLM connector, checked once.

Either a kvgate config (``kvgate_config``: a dict of the usual config, or the path of a YAML
file; default: kvgate's embedded default), which the engine's worker process opens itself, or a
running gateway (``kvgate_url``: ``gateway://host:port`` or ``gateways://``), which every
process of the engine, and of other engines, shares. Unknown keys are refused, so a typo never
silently turns into a default.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.errors import ConfigError

DEFAULT_CHUNK_SIZE = 256
DEFAULT_SEED = "0"
DEFAULT_MAX_PENDING_SAVES = 64
DEFAULT_TIMEOUT = 30.0
DEFAULT_LOOKUP_TIMEOUT = 5.0
DEFAULT_LOCAL_MEMORY = "1GiB"

KNOWN = (
    "kvgate_config",
    "kvgate_url",
    "token",
    "chunk_size",
    "seed",
    "model_id",
    "max_pending_saves",
    "timeout",
    "lookup_timeout",
    "local_memory",
)


@dataclass(frozen=True, slots=True)
class VllmSettings:
    """``config``: the kvgate config the worker opens (None with ``url``). ``url``: a running
    gateway. ``chunk_size``: tokens a stored chunk holds (a multiple of vLLM's block size).
    ``seed``: the chunk hash chain's seed, the same in every process sharing the cache.
    ``model_id``: the model's name in keys (default: vLLM's served model name).
    ``max_pending_saves``: chunks copied out and not yet stored, past which a save is skipped
    (and counted). ``timeout``: seconds a load may take. ``lookup_timeout``: seconds the
    scheduler waits for a lookup, during which vLLM's whole engine waits (a lookup that takes
    longer is a miss, and lookups are misses without asking for a while after it, see
    ``lookup.SocketLookup``). ``local_memory``: with
    ``url``, the worker's own memory tier in front of the gateway (chunks a lookup verified
    wait there for their load)."""

    config: dict[str, Any] | str | None = None
    url: str | None = None
    token: str | None = None
    chunk_size: int = DEFAULT_CHUNK_SIZE
    seed: str = DEFAULT_SEED
    model_id: str | None = None
    max_pending_saves: int = DEFAULT_MAX_PENDING_SAVES
    timeout: float = DEFAULT_TIMEOUT
    lookup_timeout: float = DEFAULT_LOOKUP_TIMEOUT
    local_memory: str | int = DEFAULT_LOCAL_MEMORY

    def __repr__(self) -> str:  # the token never shows
        shown = "***" if self.token else None
        return (
            f"VllmSettings(config={self.config!r}, url={self.url!r}, token={shown}, "
            f"chunk_size={self.chunk_size}, seed={self.seed!r}, model_id={self.model_id!r}, "
            f"max_pending_saves={self.max_pending_saves}, timeout={self.timeout}, "
            f"lookup_timeout={self.lookup_timeout}, local_memory={self.local_memory!r})"
        )

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> VllmSettings:
        unknown = sorted(set(extra) - set(KNOWN))
        if unknown:
            hints = [difflib.get_close_matches(k, KNOWN, n=1) for k in unknown]
            said = ", ".join(
                f"{k!r}" + (f" (did you mean {h[0]!r}?)" if h else "")
                for k, h in zip(unknown, hints, strict=True)
            )
            raise ConfigError(f"kv_connector_extra_config: unknown key {said}")
        config = extra.get("kvgate_config")
        url = extra.get("kvgate_url")
        if config is not None and url is not None:
            raise ConfigError("kv_connector_extra_config: kvgate_config or kvgate_url, not both")
        if config is not None and not isinstance(config, dict | str):
            raise ConfigError("kvgate_config: a config dict or the path of a YAML file")
        if url is not None and (
            not isinstance(url, str) or url.split("://", 1)[0] not in ("gateway", "gateways")
        ):
            raise ConfigError(f"kvgate_url: gateway://host:port or gateways://..., not {url!r}")
        token = extra.get("token")
        if token is not None and (not isinstance(token, str) or url is None):
            raise ConfigError("token: a string, and only with kvgate_url")
        settings = cls(
            config=config,
            url=url,
            token=token,
            chunk_size=_positive_int(extra, "chunk_size", DEFAULT_CHUNK_SIZE),
            seed=str(extra.get("seed", DEFAULT_SEED)),
            model_id=extra.get("model_id"),
            max_pending_saves=_positive_int(extra, "max_pending_saves", DEFAULT_MAX_PENDING_SAVES),
            timeout=_positive_float(extra, "timeout", DEFAULT_TIMEOUT),
            lookup_timeout=_positive_float(extra, "lookup_timeout", DEFAULT_LOOKUP_TIMEOUT),
            local_memory=extra.get("local_memory", DEFAULT_LOCAL_MEMORY),
        )
        if settings.model_id is not None and not isinstance(settings.model_id, str):
            raise ConfigError("model_id: a string")
        if isinstance(settings.local_memory, bool) or not isinstance(
            settings.local_memory, str | int
        ):
            raise ConfigError("local_memory: a size (bytes, or a string like '1GiB')")
        if "local_memory" in extra and url is None:
            raise ConfigError("local_memory: only with kvgate_url (a kvgate_config says its tiers)")
        return settings

    def check_block_size(self, block_size: int) -> None:
        if self.chunk_size % block_size:
            raise ConfigError(
                f"chunk_size {self.chunk_size} is not a multiple of vLLM's block size "
                f"{block_size}: a chunk must be whole blocks"
            )


def _positive_int(extra: Mapping[str, Any], name: str, default: int) -> int:
    value = extra.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name}: a positive integer, not {value!r}")
    return value


def _positive_float(extra: Mapping[str, Any], name: str, default: float) -> float:
    value = extra.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(f"{name}: a positive number of seconds, not {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{name}: a finite number of seconds, not {value!r}")
    return float(value)
