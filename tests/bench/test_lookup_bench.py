"""``kvgate bench lookup``: every point measured, every key found, baselines beside them."""

from __future__ import annotations

import json

import pytest
from servers.redis import RedisNode
from typer.testing import CliRunner

from gateway.cli.app import app


def test_cli_lookup_reports_each_stack_and_length(redis_server: RedisNode) -> None:
    args = ["bench", "lookup", "-s", "memory", "-s", "memory,file", "-s", "memory,file,redis"]
    args += ["--lengths", "3,70", "--rounds", "3", "--redis", redis_server.url, "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    points = json.loads(result.stdout)["points"]
    assert [(p["stack"], p["length"]) for p in points] == [
        (stack, n) for stack in ("memory", "memory+file", "memory+file+redis") for n in (3, 70)
    ]
    baselines = {p["stack"]: p["baseline"] for p in points}
    assert baselines == {
        "memory": "set membership",
        "memory+file": "os.stat per key (thread)",
        "memory+file+redis": "redis-py pipelined EXISTS",
    }
    for p in points:
        assert p["rounds"] == 3
        assert 0 < p["p50_ms"] <= p["p99_ms"]
        assert p["ratio"] == pytest.approx(p["p50_ms"] / p["baseline_p50_ms"])
    assert all(p["floor_p50_ms"] > 0 for p in points if p["stack"].endswith("redis"))


def test_cli_lookup_refuses_bad_lengths() -> None:
    result = CliRunner().invoke(app, ["bench", "lookup", "--lengths", "0,4"])
    assert result.exit_code == 2
    assert "positive" in result.output


def test_cli_lookup_against_valkey_has_glides_baseline(valkey_server: str) -> None:
    args = ["bench", "lookup", "-s", f"memory,{valkey_server}", "--lengths", "3,70"]
    result = CliRunner().invoke(app, [*args, "--rounds", "3", "--json"])
    assert result.exit_code == 0, result.output
    points = json.loads(result.stdout)["points"]
    assert [p["length"] for p in points] == [3, 70]
    for p in points:
        assert p["baseline"] == "glide pipelined EXISTS"
        assert p["baseline_p50_ms"] > 0
        assert p["floor_p50_ms"] > 0
        assert p["ratio"] == pytest.approx(p["p50_ms"] / p["baseline_p50_ms"])
