"""``benchmarks/call_overhead.py`` runs end to end at a tiny size and reports every figure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from servers.redis import RedisNode

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "call_overhead.py"


def run(*args: str) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--calls", "50", "--runs", "1", "--json", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    figures: dict[str, float] = json.loads(done.stdout)["us_loop_cpu_per_call"]
    return figures


def test_blackhole_figures_cover_every_level() -> None:
    figures = run()
    assert set(figures) == {
        "connector put",
        "timeout layer",
        "retry layer",
        "breaker layer",
        "limit layer",
        "metrics layer",
        "whole stack",
        "ConnectorTier.write",
        "Store.put",
    }
    assert all(micros > 0 for micros in figures.values())


def test_a_real_tier_is_put_and_got(redis_server: RedisNode) -> None:
    figures = run("--tier", redis_server.url)
    assert set(figures) == {"Store.put (through)", "Store.get"}
    assert all(micros > 0 for micros in figures.values())
