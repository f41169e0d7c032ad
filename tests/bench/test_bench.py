"""How ``kvgate bench`` combines repeated runs: medians of each side, ratios of medians."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from servers.redis import RedisNode
from typer.testing import CliRunner

from connectors.redis import RedisConnector
from gateway.bench.store import BenchResult, bench_sources, combine_runs, run_bench
from gateway.cli.app import app
from gateway.client_baseline import baseline_objects


def _run(put: float, base_put: tuple[float, float], *, hits: int = 4) -> BenchResult:
    r = BenchResult(["file:///x"], 1 << 20, 4, 1, "disk")
    r.put_gbps, r.get_gbps, r.get_copy_gbps = put, 2 * put, put / 2
    r.put_runs, r.get_runs, r.get_copy_runs = [put], [2 * put], [put / 2]
    r.baseline_put_runs = list(base_put)
    r.baseline_get_runs = [4.0, 4.0]
    r.baseline_put_gbps = sum(base_put) / 2
    r.baseline_get_gbps = 4.0
    r.p50_ms, r.p99_ms = put, 10 * put
    r.get_hits = hits
    r.errors = {"file:///x": {"timeout": 1}}
    return r


def test_ratios_are_of_each_sides_median() -> None:
    # Bimodal baselines, as on a VM disk: the median run's own ratio would be 1.0/1.0 or
    # 1.0/2.0 by chance; the ratio of medians compares each side's typical speed.
    runs = [_run(1.0, (1.0, 2.0)), _run(1.8, (2.0, 2.0)), _run(1.6, (1.0, 2.0))]
    out = combine_runs(runs)
    assert out.put_runs == [1.0, 1.8, 1.6]
    assert out.baseline_put_runs == [1.0, 2.0, 2.0, 2.0, 1.0, 2.0]
    assert out.put_gbps == 1.6
    assert out.baseline_put_gbps == 2.0
    assert out.put_ratio == pytest.approx(0.8)
    assert out.get_ratio == pytest.approx(3.2 / 4.0)
    assert out.get_copy_ratio == pytest.approx(0.8 / 4.0)
    assert out.p50_ms == 1.6
    assert out.p99_ms == 16.0


def test_misses_and_errors_of_any_run_show() -> None:
    out = combine_runs([_run(1.0, (1.0, 1.0)), _run(1.0, (1.0, 1.0), hits=3)])
    assert out.get_hits == 3
    assert out.errors == {"file:///x": {"timeout": 2}}


def test_one_run_is_itself_and_none_is_an_error() -> None:
    run = _run(1.0, (1.0, 1.0))
    assert combine_runs([run]) is run
    with pytest.raises(ValueError, match="at least one run"):
        combine_runs([])


def test_zero_copy_get_has_no_ratio() -> None:
    runs = [_run(1.0, (1.0, 1.0)), _run(2.0, (1.0, 1.0))]
    for r in runs:
        r.get_zero_copy = True
    assert combine_runs(runs).get_ratio == 0.0


def test_cli_repeat_reports_every_run(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/disk"
    args = ["bench", "-t", url, "--size", "1MiB", "-n", "4", "--repeat", "2", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert len(data["put_runs"]) == 2
    assert len(data["baseline_put_runs"]) == 4
    assert data["put_gbps"] == pytest.approx(
        sorted(data["put_runs"])[0] / 2 + sorted(data["put_runs"])[1] / 2
    )
    assert data["put_ratio"] == pytest.approx(data["put_gbps"] / data["baseline_put_gbps"])
    assert data["get_hits"] == 4


@pytest.mark.parametrize("nbytes", ["1MiB", str((1 << 20) + 5)])
def test_cli_direct_io_tier_has_an_o_direct_baseline(tmp_path: Path, nbytes: str) -> None:
    """With direct_io the disk baseline bypasses the page cache too (baseline disk-direct),
    also for a size that is not a block multiple; every object is read back."""
    url = f"file://{tmp_path}/disk"
    args = ["bench", "-t", url, "--size", nbytes, "-n", "4", "--repeat", "1", "--json"]
    args += ["--tier-options", '{"direct_io": true}']
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["baseline"] == "disk-direct"
    assert data["get_hits"] == 4
    assert data["errors"] == {}
    assert data["baseline_put_gbps"] > 0
    assert data["baseline_get_gbps"] > 0


@pytest.fixture
def client_baseline_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The arguments of every call the bench makes to redis-py's baseline (which still runs)."""
    calls: list[dict[str, Any]] = []
    measure = RedisConnector.raw_client_baseline

    async def recorded(
        cls: type[RedisConnector], url: str, options: Any, **kwargs: Any
    ) -> tuple[float, float]:
        calls.append(kwargs)
        return await measure(url, options, **kwargs)

    monkeypatch.setattr(RedisConnector, "raw_client_baseline", classmethod(recorded))
    return calls


@pytest.mark.parametrize(("policy", "in_flight"), [("back", {1, 4}), ("through", {1})])
async def test_the_client_baseline_puts_as_many_at_once_as_the_store(
    redis_server: RedisNode,
    client_baseline_calls: list[dict[str, Any]],
    policy: str,
    in_flight: set[int],
) -> None:
    """Write-back puts leave through the tier's 4 writers; a write-through put holds its caller
    (the bench's concurrency, 1) until the tier has it: the raw client gets the same number of
    puts in flight, or the ratio compares 4 streams with 1."""
    result = await run_bench(
        [redis_server.url],
        size=64 << 10,
        count=8,
        kind="bytes",
        baseline="client",
        write_policy=policy,
    )
    assert result.get_hits == 8
    assert result.baseline_put_gbps > 0
    assert {call["concurrency"] for call in client_baseline_calls} == in_flight


@pytest.mark.parametrize("kind", ["bytes", "ndarray"])
async def test_the_client_baseline_puts_the_stores_distinct_objects(
    redis_server: RedisNode, client_baseline_calls: list[dict[str, Any]], kind: str
) -> None:
    """The raw client sends the objects the Store puts (distinct memory, like an engine's
    chunks), not one object again and again, which a 1 MiB put would send from the CPU
    cache."""
    size, count = 64 << 10, 8
    await run_bench([redis_server.url], size=size, count=count, kind=kind, baseline="client")
    rows = [row.tobytes() for row in bench_sources(size, count, 1)]
    assert len(set(rows)) == count
    assert client_baseline_calls
    for call in client_baseline_calls:
        assert list(call["payloads"]) == rows


def test_baseline_objects_are_checked_or_made() -> None:
    assert baseline_objects(3, [b"abc", b"def"]) == [b"abc", b"def"]
    made = baseline_objects(5, [])
    assert [len(m) for m in made] == [5]
    with pytest.raises(ValueError, match="payload 1 is 2 bytes, not 3"):
        baseline_objects(3, [b"abc", b"de"])


async def test_a_baseline_without_payloads_still_runs(
    redis_server: RedisNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plugin's ``raw_client_baseline`` written before ``payloads`` existed keeps working."""
    measure = RedisConnector.raw_client_baseline
    calls: list[int] = []

    async def old_style(
        cls: type[RedisConnector],
        url: str,
        options: Any,
        *,
        size: int,
        count: int,
        concurrency: int,
    ) -> tuple[float, float]:
        calls.append(size)
        return await measure(url, options, size=size, count=count, concurrency=concurrency)

    monkeypatch.setattr(RedisConnector, "raw_client_baseline", classmethod(old_style))
    result = await run_bench([redis_server.url], size=64 << 10, count=4, baseline="client")
    assert result.baseline_put_gbps > 0
    assert calls
