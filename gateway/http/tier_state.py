"""What each tier of a Store looks like right now: one snapshot for /v1/tiers and /metrics.

Read from what the store and the layer stack already keep (``TierStats``, the breaker, the
write queue, the connector's ``usage()``); nothing here is counted twice.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.config import redact_url
from gateway.layers import BreakerState, CircuitBreakerLayer, find_layer
from gateway.store import Store
from gateway.types import TierStats

# A tier is "up" while its breaker is closed (or it has none), "probing" while one call tests
# it, "down" while calls fail fast.
STATE_OF_BREAKER: dict[BreakerState, str] = {
    "closed": "up",
    "half_open": "probing",
    "open": "down",
}


@dataclass(frozen=True, slots=True)
class TierState:
    name: str
    url: str  # redacted: no password or secret parameter
    state: str
    breaker: BreakerState | None
    used_bytes: int
    capacity_bytes: int | None
    queue_depth: int
    queue_size: int | None
    writes_in_flight: int
    stats: TierStats

    def as_dict(self) -> dict[str, object]:
        s = self.stats
        return {
            "name": self.name,
            "url": self.url,
            "state": self.state,
            "breaker": self.breaker,
            "used_bytes": self.used_bytes,
            "capacity_bytes": self.capacity_bytes,
            "queue_depth": self.queue_depth,
            "queue_size": self.queue_size,
            "writes_in_flight": self.writes_in_flight,
            "hits": s.hits,
            "misses": s.misses,
            "bytes_read": s.bytes_read,
            "bytes_written": s.bytes_written,
            "puts": s.puts,
            "errors": dict(s.errors),
            "corrupt": s.corrupt,
            "skipped_writes": s.skipped_writes,
            "evictions": s.evictions,
        }


def tier_states(store: Store) -> list[TierState]:
    """Every tier in order, fastest first; empty before the store is open."""
    configs = list(store.config.tiers)
    out: list[TierState] = []
    if store.l1 is not None:
        pool = store.l1.pool
        url = redact_url(configs.pop(0).url)
        out.append(
            TierState(
                store.l1.name, url, "up", None, pool.used, pool.capacity, 0, None, 0, store.l1.stats
            )
        )
    for tier, writer, cfg in zip(store.tiers, store.writers, configs, strict=False):
        breaker_layer = find_layer(tier.connector, CircuitBreakerLayer)
        breaker = breaker_layer.state if breaker_layer is not None else None
        used, capacity = tier.connector.usage()
        out.append(
            TierState(
                name=tier.name,
                url=redact_url(cfg.url),
                state=STATE_OF_BREAKER[breaker or "closed"],
                breaker=breaker,
                used_bytes=used,
                capacity_bytes=capacity,
                queue_depth=writer.queue.qsize(),
                queue_size=writer.queue.maxsize,
                writes_in_flight=writer.in_flight,
                stats=tier.stats,
            )
        )
    return out
