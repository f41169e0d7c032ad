"""Real decoder K/V: SmolLM2-135M's post-RoPE keys and values, chunk by chunk, over texts that
ship with the machine (``texts``), for measuring and calibrating codecs.

``smollm2_chunks(split)`` gives the chunks of the calibration or the test texts in LMCache's
KV_2LTD layout ``[2, layers=30, tokens, kv_heads * head_dim = 192]`` (token-major, heads
concatenated in the last dimension, as vLLM flattens ``[tokens, heads, head_dim]``), each with
the position of its first token, and the ``RopeParams`` that rotated the keys (to undo RoPE:
position ``p``, pair ``(i, i + head_dim/2)`` of a head was rotated by ``p * theta **
(-2i/head_dim)``, transformers' ``rotate_half`` convention). ``smollm2_kv`` is the
``kvgate bench codecs --sample smollm2`` sample: the first 1024 tokens of the test texts, with
the model's queries (chunk-local attention error) and an end-to-end measure (``end_to_end``).

The model runs in float32 on the CPU; K/V are kept in the dtype asked for (float16 by
default, what a store holds). Nothing is cached on disk: loading the model (about 7 s) and
capturing the 4 calibration texts (about 33 s on 2 cores) is short next to what calibration
does with them, and a fresh CI machine would start without a cache anyway.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.bench.texts import Split, Text, texts

if TYPE_CHECKING:
    import torch

    from gateway.bench.kv_capture import Recorder
    from gateway.bench.kv_samples import KVSample

CHUNK_TOKENS = 256  # LMCache's default chunk size
CALIBRATION_TOKENS = 2048
PREFIX_TOKENS = 1024  # test texts: the prefix whose K/V is stored ...
CONTINUATION_TOKENS = 512  # ... and what the model reads on top of it, end to end


@dataclass(frozen=True)
class RopeParams:
    """How the keys were rotated: transformers' Llama RoPE with these parameters."""

    theta: float
    head_dim: int
    rope_type: str = "default"
    scaling: dict[str, Any] | None = None  # rope_type's other parameters, if any


@dataclass(frozen=True)
class Chunk:
    kv: torch.Tensor  # [2, layers, tokens, kv_heads * head_dim], KV_2LTD
    start: int  # position of the first token in its text
    text: str  # the text's name, "license:GPL-3"
    queries: torch.Tensor | None = None  # [layers, tokens, heads * head_dim], float32, post-RoPE


class SmolLM2:
    """The loaded model: tokens in, post-RoPE Q/K/V or next-token log-probabilities out."""

    def __init__(self, model: Any, tokenizer: Any, recorder: Recorder) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.recorder = recorder
        config = model.config
        self.layers = int(config.num_hidden_layers)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", config.hidden_size // self.heads))
        # The forward's cache argument: ``cache`` since transformers 5.2x, before that
        # ``past_key_values`` (still accepted, with a deprecation warning).
        params = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"

    @property
    def rope(self) -> RopeParams:
        config = self.model.config
        # transformers 5: everything in rope_parameters; before: rope_theta and rope_scaling.
        params = getattr(config, "rope_parameters", None)
        if params is None:
            params = {"rope_theta": config.rope_theta, **(config.rope_scaling or {})}
        params = dict(params)
        theta = float(params.pop("rope_theta"))
        rope_type = str(params.pop("rope_type", "default"))
        return RopeParams(theta, self.head_dim, rope_type, params or None)

    def tokens(self, text: str, count: int) -> torch.Tensor:
        """The first ``count`` token ids of ``text`` (ValueError if it is shorter)."""
        ids: torch.Tensor = self.tokenizer(text, return_tensors="pt").input_ids[0]
        if len(ids) < count:
            raise ValueError(f"the text has {len(ids)} tokens, fewer than {count}")
        return ids[:count]

    def capture(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``ids`` from position 0: (K/V ``[2, layers, tokens, kv_heads*head_dim]``,
        queries ``[layers, tokens, heads*head_dim]``), float32, post-RoPE."""
        import torch

        with torch.no_grad(), self.recorder.recording() as rec:
            self.model(input_ids=ids[None], use_cache=False)

        def flat(per_layer: dict[int, torch.Tensor]) -> torch.Tensor:
            # [heads, tokens, head_dim] per layer -> [layers, tokens, heads*head_dim]
            return torch.stack(
                [per_layer[i].transpose(0, 1).reshape(len(ids), -1) for i in range(self.layers)]
            )

        return torch.stack([flat(rec.keys), flat(rec.values)]), flat(rec.queries)

    def continue_log_probs(self, kv: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Log-probabilities ``[len(ids), vocab]`` of the next token at each of ``ids``, read
        on top of a cache holding ``kv`` (KV_2LTD, any float dtype) for the tokens before."""
        import torch
        from transformers import DynamicCache

        tokens = kv.shape[2]

        def heads(x: torch.Tensor) -> torch.Tensor:  # [tokens, kv_heads*hd] -> [1, kvh, t, hd]
            return x.float().reshape(tokens, self.kv_heads, self.head_dim).transpose(0, 1)[None]

        cache = DynamicCache(
            ddp_cache_data=[(heads(kv[0, i]), heads(kv[1, i])) for i in range(self.layers)]
        )
        with torch.no_grad():
            out = self.model(input_ids=ids[None], use_cache=True, **{self.cache_arg: cache})
        log_probs: torch.Tensor = torch.log_softmax(out.logits[0].float(), dim=-1)
        return log_probs


@functools.lru_cache(maxsize=1)
def load_smollm2(folder: Path | None = None) -> SmolLM2:
    """The model from ``folder`` or where ``smollm2_model`` finds it (loaded once)."""
    from gateway.bench import smollm2_model

    return SmolLM2(*smollm2_model.load(smollm2_model.model_dir(folder)))


def smollm2_chunks(
    split: Split,
    *,
    count: int | None = None,
    tokens: int | None = None,
    chunk_tokens: int = CHUNK_TOKENS,
    dtype: Any = None,
    queries: bool = False,
    model_dir: Path | None = None,
) -> tuple[list[Chunk], RopeParams]:
    """Chunks of the first ``count`` texts of ``split`` (all 4 by default), each text cut to
    ``tokens`` (calibration 2048, test 1024: the prefix the end-to-end measure decodes) and
    run from position 0; K/V in ``dtype`` (float16 by default), queries when asked for."""
    import torch

    if tokens is None:
        tokens = CALIBRATION_TOKENS if split == "calibration" else PREFIX_TOKENS
    if tokens % chunk_tokens:
        raise ValueError(f"tokens ({tokens}) must be whole chunks of {chunk_tokens}")
    model = load_smollm2(model_dir)
    chunks = []
    for text in _first(texts(split), count):
        kv, q = model.capture(model.tokens(text.read(), tokens))
        kv = kv.to(dtype or torch.float16)
        for start in range(0, tokens, chunk_tokens):
            part = slice(start, start + chunk_tokens)
            chunk_q = q[:, part].contiguous() if queries else None
            chunks.append(Chunk(kv[:, :, part].contiguous(), start, text.name, chunk_q))
    return chunks, model.rope


def smollm2_kv(
    count: int = 2,
    *,
    dtype: Any = None,
    model_dir: Path | None = None,
    prefix_tokens: int = PREFIX_TOKENS,
    continuation_tokens: int = CONTINUATION_TOKENS,
) -> KVSample:
    """The bench sample: the 1024-token prefixes of the first ``count`` test texts as chunks
    of 256 tokens (K/V ``[2, 30, count*1024, 192]``), their queries, and the end-to-end
    measure that continues each text for 512 tokens on the decoded prefix."""
    import torch

    from gateway.bench.end_to_end import PrefixContinuation
    from gateway.bench.kv_samples import KVSample

    if prefix_tokens % CHUNK_TOKENS:
        raise ValueError(f"the prefix must be whole chunks of {CHUNK_TOKENS} tokens")
    model = load_smollm2(model_dir)
    dtype = dtype or torch.float16
    prefixes, queries, continuations = [], [], []
    for text in _first(texts("test"), count):
        ids = model.tokens(text.read(), prefix_tokens + continuation_tokens)
        kv, q = model.capture(ids[:prefix_tokens])
        prefixes.append(kv.to(dtype))
        queries.append(q)
        continuations.append(ids[prefix_tokens:])
    kv = torch.cat(prefixes, dim=2)
    e2e = PrefixContinuation(model, prefixes, continuations)
    return KVSample(
        "smollm2",
        kv,
        torch.cat(queries, dim=1),
        model.heads,
        kv_heads=model.kv_heads,
        chunk_tokens=CHUNK_TOKENS,
        end_to_end=e2e,
        positions=[start for _ in prefixes for start in range(0, prefix_tokens, CHUNK_TOKENS)],
    )


def _first(items: Sequence[Text], count: int | None) -> Sequence[Text]:
    if count is not None and not 1 <= count <= len(items):
        raise ValueError(f"count must be 1..{len(items)}")
    return items if count is None else items[:count]
