"""``kvgate calibrate``: from a safetensors file of chunks (with positions) into a file and a
store, which a reader that never saw the calibration then uses."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import yaml
from kvtc_data import ROPE, correlated_kv
from safetensors.torch import save_file
from typer.testing import CliRunner

from gateway import Store
from gateway.cli.app import app
from gateway.types import MemoryFormat
from serde.kvtc import registry

runner = CliRunner()


def test_calibrate_from_a_chunk_file_into_a_store(tmp_path: Path) -> None:
    chunks = {f"c{i}": correlated_kv(64, 64 * i, seed=300 + i) for i in range(4)}
    positions = json.dumps({name: 64 * i for i, name in enumerate(chunks)})
    save_file(chunks, str(tmp_path / "chunks.safetensors"), metadata={"positions": positions})
    store_cfg = tmp_path / "store.yaml"
    store_cfg.write_text(yaml.safe_dump({"tiers": [{"url": f"file://{tmp_path / 'disk'}"}]}))
    out = tmp_path / "model.kvtc"
    args = ["calibrate", str(out), "--chunks", str(tmp_path / "chunks.safetensors")]
    args += ["--group", "2", "--rel-error", "0.03", "--head-dim", str(ROPE.head_dim)]
    args += ["--rope-theta", str(ROPE.theta), "--put", str(store_cfg)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    sha = result.output.split()[1]
    assert out.is_file()
    assert "basis" in result.output
    # A writer with the file, a reader without anything: the reader fetches it by hash.
    kv = correlated_kv(64, 4096, seed=399)
    tier = {"url": f"file://{tmp_path / 'disk'}", "codec": "kvtc"}
    writer = {"tiers": [{**tier, "codec_options": {"calibration": str(out)}}]}

    async def write() -> None:
        async with Store(writer) as store:
            await store.put("chunk", kv, fmt=MemoryFormat.KV_2LTD, position=4096)

    async def read() -> object:
        async with Store({"tiers": [tier]}) as store:
            assert await store.contains(registry.key_of(sha))
            return await store.get("chunk")

    asyncio.run(write())
    registry.forget_all()
    got = asyncio.run(read())
    assert registry.lookup(sha) is not None
    err = float((got.float() - kv.float()).norm() / kv.float().norm())  # type: ignore[union-attr]
    assert err < 0.05


def test_calibrate_needs_exactly_one_source(tmp_path: Path) -> None:
    result = runner.invoke(app, ["calibrate", str(tmp_path / "x")])
    assert result.exit_code == 2
    assert "exactly one" in result.output


def test_model_weights_need_a_model_sample(tmp_path: Path) -> None:
    chunks = {"c0": correlated_kv(64, 0, seed=300)}
    save_file(chunks, str(tmp_path / "chunks.safetensors"))
    args = ["calibrate", str(tmp_path / "x"), "--chunks", str(tmp_path / "chunks.safetensors")]
    result = runner.invoke(app, [*args, "--weights", "model"])
    assert result.exit_code == 2
    assert "needs a model" in result.output
    result = runner.invoke(app, [*args, "--weights", "heavy"])
    assert result.exit_code == 2
    assert "--weights must be one of" in result.output
    assert not (tmp_path / "x").exists()


def test_calibrate_warns_when_the_samples_cannot_span_a_layer_group(tmp_path: Path) -> None:
    from kvtc_data import CHANNELS, LAYERS

    chunks = {"c0": correlated_kv(16, 0, seed=310)}  # 16 tokens; a group has more features
    save_file(chunks, str(tmp_path / "chunks.safetensors"))
    out = tmp_path / "model.kvtc"
    args = ["calibrate", str(out), "--chunks", str(tmp_path / "chunks.safetensors")]
    result = runner.invoke(app, [*args, "--group", str(LAYERS)])
    assert result.exit_code == 0, result.output
    assert f"16 tokens for {LAYERS * CHANNELS} features" in " ".join(result.output.split())


def test_calibrate_warns_when_its_own_chunks_would_go_to_cachegen(tmp_path: Path) -> None:
    """A calibration too loose for kvtc's guard (serde.kvtc.guard) is never used: said."""
    chunks = {f"c{i}": correlated_kv(64, 64 * i, seed=300 + i) for i in range(4)}
    positions = json.dumps({name: 64 * i for i, name in enumerate(chunks)})
    save_file(chunks, str(tmp_path / "chunks.safetensors"), metadata={"positions": positions})
    args = ["calibrate", str(tmp_path / "x"), "--chunks", str(tmp_path / "chunks.safetensors")]
    args += ["--head-dim", str(ROPE.head_dim), "--rope-theta", str(ROPE.theta)]
    tight = runner.invoke(app, [*args, "--rel-error", "0.03"])
    assert tight.exit_code == 0, tight.output
    assert "cachegen" not in tight.output
    loose = runner.invoke(app, [*args, "--rel-error", "0.4"])
    assert loose.exit_code == 0, loose.output
    assert "codes 4 of these 4 chunks with cachegen" in " ".join(loose.output.split())
