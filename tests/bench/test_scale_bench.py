"""``kvgate bench scale``: the growth curves run end to end at tiny sizes and report every
figure the README's table is built from; the growth exponent is a plain log-log fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gateway.bench.scale_plot import draw_scale
from gateway.bench.scale_stats import loglog_slope, memory_of
from gateway.cli.app import app


def test_objects_curve_reports_each_level(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    args = ["bench", "scale", "--curve", "objects", "--objects", "40", "--samples", "4"]
    result = CliRunner().invoke(app, [*args, "--dir", str(disk), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    points = report["objects"]["points"]
    assert [p["objects"] for p in points] == [40]
    for p in points:
        assert p["get_hits"] == p["samples"] == 4  # random gets of filled keys all hit
        assert 0 < p["put_p50_ms"] <= p["put_p99_ms"]
        assert 0 < p["get_p50_ms"] <= p["get_p99_ms"]
        assert p["rss_after_open"] > 0
        assert p["open_s"] > 0
        assert p["snapshot_open_s"] > 0
        assert p["snapshot_bytes"] > 0
        assert p["fill_ops_per_s"] > 0
        assert p["listed"] == p["objects"]  # every key once, page by page
    assert set(report["objects"]["slopes"]) >= {"open_s", "index_bytes", "put_p99_ms"}
    # The probes were deleted again: the directory holds exactly the last level's objects.
    assert sum(1 for f in (disk / "objects").rglob("*.kvo")) == 40
    assert "clients" not in report


def test_clients_curve(tmp_path: Path) -> None:
    args = ["bench", "scale", "--curve", "clients", "--clients", "1,2", "--sizes", "4KiB"]
    args += ["--duration", "0.1", "--serve-memory", "32MiB", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)["clients"]
    assert [(p["size"], p["clients"]) for p in report["points"]] == [(4096, 1), (4096, 2)]
    for p in report["points"]:
        for phase in ("put", "get"):
            assert p[phase]["ops"] > 0
            assert p[phase]["errors"] == 0
            assert 0 < p[phase]["p50_ms"] <= p[phase]["p99_ms"]
        assert p["server_rss"] > 0
    assert set(report["slopes"]) == {"put 4096", "get 4096"}


def test_plot_draws_both_curves(tmp_path: Path) -> None:
    phase = {"ops_per_s": 100.0, "p99_ms": 2.0}
    served = [{"size": 4096, "clients": c, "put": phase, "get": phase} for c in (1, 2)]
    level = dict.fromkeys(("put_p50_ms", "put_p99_ms", "get_p50_ms", "get_p99_ms"), 1.0)
    stored = [
        level | {"objects": n, "index_bytes_per_object": 400.0, "open_s": n / 1e4}
        for n in (10, 100)
    ]
    report = {"objects": {"points": stored, "object_size": 4096}, "clients": {"points": served}}
    png = tmp_path / "scale.png"
    draw_scale(report, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_directory_with_files_is_refused(tmp_path: Path) -> None:
    (tmp_path / "mine.txt").write_text("not the bench's")
    args = ["bench", "scale", "--curve", "objects", "--objects", "10", "--dir", str(tmp_path)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert (tmp_path / "mine.txt").exists()


@pytest.mark.parametrize(
    ("ys", "slope"),
    [([5.0, 5.0, 5.0], 0.0), ([1.0, 10.0, 100.0], 1.0), ([1.0, 100.0, 10000.0], 2.0)],
)
def test_slope_is_the_growth_exponent(ys: list[float], slope: float) -> None:
    assert loglog_slope([1.0, 10.0, 100.0], ys) == pytest.approx(slope)


def test_slope_needs_two_positive_points() -> None:
    assert loglog_slope([1.0], [2.0]) is None
    assert loglog_slope([1.0, 10.0], [0.0, 3.0]) is None


def test_memory_of_this_process() -> None:
    rss, peak = memory_of()
    assert 0 < rss <= peak
