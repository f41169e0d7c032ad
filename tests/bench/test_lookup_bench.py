"""``kvgate bench lookup``: every point measured, every key found, baselines beside them."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from servers.redis import RedisNode
from servers.s3 import S3Server
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


def lookup_points(stack: str, *extra: str) -> list[dict[str, Any]]:
    args = ["bench", "lookup", "-s", stack, "--lengths", "3,70", "--rounds", "3", "--json"]
    result = CliRunner().invoke(app, [*args, *extra])
    assert result.exit_code == 0, result.output
    points: list[dict[str, Any]] = json.loads(result.stdout)["points"]
    assert [p["length"] for p in points] == [3, 70]
    for p in points:
        assert p["baseline_p50_ms"] > 0
        assert p["ratio"] == pytest.approx(p["p50_ms"] / p["baseline_p50_ms"])
    return points


def test_cli_lookup_against_memcached_has_aiomcaches_baseline(memcached_server: str) -> None:
    points = lookup_points(f"memory,{memcached_server}")
    assert {p["baseline"] for p in points} == {"aiomcache multi_get"}


@pytest.mark.parametrize(
    ("scheme", "baseline"),
    [
        ("s3", "aioboto3 HEAD per key, 16 at once"),
        ("obstore+s3", "obstore head_async per key, 16 at once"),
    ],
)
def test_cli_lookup_against_s3_takes_tier_options_and_has_the_clients_baseline(
    s3_server: S3Server, scheme: str, baseline: str
) -> None:
    """The endpoint and credentials come from --tier-options (without them the connector
    could not reach SeaweedFS), and the baseline HEADs the objects the tier wrote."""
    prefix = f"lookup-{uuid.uuid4().hex[:8]}"
    stack = f"memory,{scheme}://{s3_server.bucket}/{prefix}"
    points = lookup_points(stack, "--tier-options", json.dumps(s3_server.options()))
    # A HEAD of a name the tier did not write fails the baseline, and with it the bench.
    assert {p["baseline"] for p in points} == {baseline}
    left = s3_server.client().list_objects_v2(Bucket=s3_server.bucket, Prefix=prefix)
    assert left.get("KeyCount", 0) == 0  # the bench deleted what it wrote
