"""Where ``kvgate calibrate`` gets its K/V chunks: a bench sample, a safetensors file, or the
chunks already in a store. Each source yields ``serde.kvtc.fit.Chunk``s (``[2, layers,
tokens, channels]`` plus the start position when it is known)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.errors import MissingDependency

if TYPE_CHECKING:
    from serde.kvtc.fit import Chunk
    from serde.kvtc.rope import Rope

SAMPLES = ("synthetic", "minilm", "smollm2")
MODEL_SAMPLES = ("smollm2",)  # samples whose model can weigh errors (``--weights model``)
WEIGHT_MODES = ("auto", "model", "none")


def from_sample(name: str, chunks: int, tokens: int) -> tuple[list[Chunk], Rope | None]:
    """``chunks`` consecutive chunks of ``tokens`` from one sequence of the named sample.

    synthetic: the bench's synthetic chunk (its model is seed 0; the calibration sequence is
    longer than the bench's chunk, so its tokens differ); minilm: MiniLM over the bench's text
    (up to 512 tokens in all; MiniLM has no RoPE); smollm2: see ``from_smollm2``. With the
    sample's RoPE (None: its keys carry none to undo)."""
    from gateway.bench.kv_samples import minilm_kv, synthetic_kv
    from serde.kvtc.fit import Chunk

    if name == "smollm2":
        return from_smollm2(chunks)
    total = chunks * tokens
    if name == "synthetic":
        kv = synthetic_kv(tokens=total).kv
    elif name == "minilm":
        kv = minilm_kv(min(total, 512)).kv
    else:
        raise ValueError(f"unknown sample {name!r} (known: {', '.join(SAMPLES)})")
    n = kv.shape[2]
    cut = [Chunk(kv[:, :, a : a + tokens].clone(), a) for a in range(0, n - tokens + 1, tokens)]
    return cut, None


def from_smollm2(chunks: int) -> tuple[list[Chunk], Rope]:
    """SmolLM2-135M's post-RoPE K/V over the bench's calibration texts (never its test texts),
    at most ``chunks`` chunks of 256 tokens taken round-robin over the texts, with their
    positions, and the model's RoPE (so keys are calibrated unrotated)."""
    from gateway.bench.smollm2_sample import smollm2_chunks
    from serde.kvtc.fit import Chunk
    from serde.kvtc.rope import Rope

    captured, rope = smollm2_chunks("calibration")
    by_text: dict[str, list[Chunk]] = {}
    for c in captured:
        by_text.setdefault(c.text, []).append(Chunk(c.kv, c.start))
    rounds = max(len(v) for v in by_text.values())
    ordered = [v[i] for i in range(rounds) for v in by_text.values() if i < len(v)]
    return ordered[:chunks], Rope(rope.head_dim, rope.theta)


def model_weights(sample: str | None, mode: str) -> list[Any] | None:
    """``--weights``: the sample model's ``kvtc`` weights (``serde.kvtc.weights``) for
    ``model`` (and ``auto`` with a model sample), None for ``none`` (and ``auto`` without)."""
    if mode not in WEIGHT_MODES:
        raise ValueError(f"--weights must be one of {', '.join(WEIGHT_MODES)}")
    if mode == "none" or (mode == "auto" and sample not in MODEL_SAMPLES):
        return None
    if sample not in MODEL_SAMPLES:
        raise ValueError(f"--weights model needs a model: --sample {' or '.join(MODEL_SAMPLES)}")
    from gateway.bench.smollm2_sample import load_smollm2
    from gateway.bench.smollm2_weights import smollm2_weights

    return smollm2_weights(load_smollm2())


def from_file(path: Path) -> list[Chunk]:
    """Every ``[2, layers, tokens, channels]`` tensor of a safetensors file; the file's
    metadata may give start positions as ``{"positions": "{\\"name\\": 256, ...}"}``."""
    try:
        from safetensors import safe_open
    except ModuleNotFoundError as exc:
        raise MissingDependency("reading chunk files needs safetensors") from exc
    from serde.kvtc.fit import Chunk

    out = []
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        positions: dict[str, Any] = json.loads(meta.get("positions", "{}"))
        for name in sorted(f.keys()):
            t = f.get_tensor(name)
            if t.dim() == 4 and t.shape[0] == 2:
                pos = positions.get(name)
                out.append(Chunk(t, int(pos) if pos is not None else None))
    return out


async def from_store(config: str, prefix: str, limit: int) -> list[Chunk]:
    """Up to ``limit`` KV_2LTD-shaped tensors stored under ``prefix`` (positions unknown)."""
    import torch

    from gateway.listing import KeyListings
    from gateway.store import Store
    from serde.kvtc.fit import Chunk

    out: list[Chunk] = []
    async with Store(config) as store:
        listings = KeyListings(store)
        after: str | None = None
        while len(out) < limit:
            page, after = await listings.page(prefix, after=after)
            for info in page:
                obj = await store.get(info.key)
                if isinstance(obj, torch.Tensor) and obj.dim() == 4 and obj.shape[0] == 2:
                    out.append(Chunk(obj.clone(), None))
                    if len(out) == limit:
                        break
            if after is None:
                break
    return out


async def put_calibration(config: str, key: str, data: bytes) -> None:
    from gateway.store import Store

    async with Store(config) as store:
        await store.put(key, data, durable=True)
