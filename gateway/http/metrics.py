"""``/metrics``: the store's per-tier counters in the Prometheus text format.

A collector reads a fresh ``tier_states`` snapshot at every scrape, so the numbers are the
ones the store and the metrics layer already keep (nothing is counted twice, nothing drifts).
Every series carries ``tier="<name>"``; latency histograms add ``op``, errors add ``kind``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from gateway.http.tier_state import STATE_OF_BREAKER, TierState, tier_states
from gateway.store import Store

CONTENT_TYPE = CONTENT_TYPE_LATEST

# (metric name, help, the TierStats field it reads)
_COUNTERS = (
    ("kvgate_tier_hits", "Reads that found the object", "hits"),
    ("kvgate_tier_misses", "Reads that did not find the object", "misses"),
    ("kvgate_tier_read_bytes", "Bytes read from the tier", "bytes_read"),
    ("kvgate_tier_written_bytes", "Bytes written to the tier", "bytes_written"),
    ("kvgate_tier_puts", "Objects written to the tier", "puts"),
    ("kvgate_tier_corrupt", "Objects that failed verification (served as misses)", "corrupt"),
    ("kvgate_tier_skipped_writes", "Writes skipped by back-pressure", "skipped_writes"),
    ("kvgate_tier_evictions", "Objects evicted to make room", "evictions"),
)


class StoreCollector(Collector):
    def __init__(self, store: Store) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        states = tier_states(self.store)
        for name, help_text, field in _COUNTERS:
            family = CounterMetricFamily(name, help_text, labels=["tier"])
            for t in states:
                family.add_metric([t.name], getattr(t.stats, field))
            yield family
        errors = CounterMetricFamily(
            "kvgate_tier_errors", "Failed calls, by error kind", labels=["tier", "kind"]
        )
        for t in states:
            for kind, n in sorted(t.stats.errors.items()):
                errors.add_metric([t.name, kind], n)
        yield errors
        yield from self._gauges(states)
        latency = HistogramMetricFamily(
            "kvgate_tier_latency_seconds", "Call latency by operation", labels=["tier", "op"]
        )
        for t in states:
            for op, hist in sorted(t.stats.latency.items()):
                buckets: list[tuple[str, float]] = []
                seen = 0
                for bound, count in zip(hist.bounds, hist.counts, strict=False):
                    seen += count
                    buckets.append((repr(bound), seen))
                buckets.append(("+Inf", hist.n))
                latency.add_metric([t.name, op], buckets, hist.total)
        yield latency

    def _gauges(self, states: list[TierState]) -> Iterator[Metric]:
        depth = GaugeMetricFamily("kvgate_tier_queue_depth", "Queued writes", labels=["tier"])
        inflight = GaugeMetricFamily(
            "kvgate_tier_writes_in_flight", "Accepted writes not finished", labels=["tier"]
        )
        used = GaugeMetricFamily("kvgate_tier_used_bytes", "Bytes stored", labels=["tier"])
        cap = GaugeMetricFamily("kvgate_tier_capacity_bytes", "Byte capacity", labels=["tier"])
        breaker = GaugeMetricFamily(
            "kvgate_tier_breaker_state",
            "1 for the breaker's current state (closed, half_open, open)",
            labels=["tier", "state"],
        )
        for t in states:
            depth.add_metric([t.name], t.queue_depth)
            inflight.add_metric([t.name], t.writes_in_flight)
            used.add_metric([t.name], t.used_bytes)
            if t.capacity_bytes is not None:
                cap.add_metric([t.name], t.capacity_bytes)
            if t.breaker is not None:
                for state in STATE_OF_BREAKER:
                    breaker.add_metric([t.name, state], 1.0 if state == t.breaker else 0.0)
        yield from (depth, inflight, used, cap, breaker)


def metrics_registry(store: Store) -> CollectorRegistry:
    """A registry of its own per app (never the process-global one: tests run many apps)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(store))
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
