"""The kvgate command: connectors listing and a small bench run, end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gateway.cli.app import app

runner = CliRunner()


def test_connectors_json() -> None:
    result = runner.invoke(app, ["connectors", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    names = {c["name"]: c for c in data["connectors"]}
    assert names["file"]["usable"]
    assert names["memory"]["usable"]
    assert {c["name"] for c in data["codecs"]} >= {"raw", "zstd"}


def test_connectors_table() -> None:
    result = runner.invoke(app, ["connectors"])
    assert result.exit_code == 0
    assert "blackhole" in result.stdout


def test_bench_memory_json() -> None:
    result = runner.invoke(app, ["bench", "--size", "64KiB", "-n", "20", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    for field in (
        "put_gbps",
        "get_gbps",
        "baseline_put_gbps",
        "baseline_get_gbps",
        "p50_ms",
        "p99_ms",
    ):
        assert data[field] > 0, field
    assert data["get_hits"] == 20
    assert data["baseline"] == "memcpy"


def test_bench_disk_tier_table(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/disk"
    result = runner.invoke(app, ["bench", "-t", url, "--size", "1MiB", "-n", "4", "--cold"])
    assert result.exit_code == 0, result.output
    assert "baseline (disk)" in result.stdout
    assert "hits 4/4" in result.stdout


def test_bench_write_through_without_a_memory_tier(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/disk"
    args = ["bench", "-t", url, "--size", "1MiB", "-n", "4", "--repeat", "1"]
    result = runner.invoke(app, [*args, "--write-policy", "through", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["write_policy"] == "through"
    assert data["get_hits"] == 4
    assert not data["errors"]
    result = runner.invoke(app, [*args, "--write-policy", "sideways"])
    assert result.exit_code == 2
    assert "back or through" in result.output


def test_serve_refuses_non_loopback() -> None:
    result = runner.invoke(app, ["serve", "--host", "0.0.0.0"])
    assert result.exit_code == 2


def test_serve_keeps_lm_private_unless_told() -> None:
    """lm:// has no authentication: a public lm:// bind is refused, with a token too."""
    for args in (
        ["serve", "--lm-port", "9999", "--lm-host", "0.0.0.0"],
        ["serve", "--token", "T0KEN", "--host", "0.0.0.0", "--lm-port", "9999", "--lm-host", "::"],
    ):
        result = runner.invoke(app, args)
        assert result.exit_code == 2
        assert "--lm-public" in result.output
        assert "T0KEN" not in result.output


@pytest.mark.parametrize("option", ["--max-body", "--body-min-rate", "--max-header-bytes"])
def test_serve_names_a_bad_size_option_without_a_traceback(option: str) -> None:
    result = runner.invoke(app, ["serve", option, "12 potatoes"])
    assert result.exit_code == 2
    assert f"{option}: malformed size" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


@pytest.mark.parametrize("option", ["--max-body", "--max-header-bytes"])
def test_serve_refuses_a_zero_size_limit_without_a_traceback(option: str) -> None:
    result = runner.invoke(app, ["serve", option, "0"])
    assert result.exit_code == 2
    assert f"{option}: must be more than 0 bytes" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


@pytest.mark.parametrize(
    ("tier", "said"),
    [
        ({"codec": "zstdd"}, "tier file: no codec named 'zstdd'"),
        ({"codec": "kvtc", "codec_options": {"calibration": "/nonexistent"}}, "tier file: codec"),
        ({"codec": "aesgcm", "codec_options": {"key_file": "/nonexistent"}}, "tier file: aesgcm"),
    ],
)
def test_serve_names_a_tier_whose_codec_cannot_be_built_without_a_traceback(
    tmp_path: Path, tier: dict[str, object], said: str
) -> None:
    config = tmp_path / "kvgate.json"
    disk = {"url": f"file://{tmp_path / 'd'}", **tier}
    config.write_text(json.dumps({"tiers": [{"url": "memory://", "capacity": "8MiB"}, disk]}))
    result = runner.invoke(app, ["serve", "--config", str(config)])
    assert result.exit_code == 2
    assert said in " ".join(result.output.split())
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_serve_names_a_bad_config_value_without_a_traceback() -> None:
    result = runner.invoke(app, ["serve"], env={"KVGATE_TIERS__0__CAPACITY": "12 potatoes"})
    assert result.exit_code == 2
    assert "KVGATE_TIERS__0__CAPACITY" in result.output
    assert "Traceback" not in result.output
