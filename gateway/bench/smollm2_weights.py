"""``kvtc`` weights for SmolLM2 (``serde.kvtc.weights``), from the model itself: its queries
and output projections on a calibration text, and each layer's measured sensitivity."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from gateway.bench.texts import texts

if TYPE_CHECKING:
    from gateway.bench.smollm2_sample import SmolLM2

Array = np.ndarray[Any, Any]
PREFIX_TOKENS = 1024
CONTINUATION_TOKENS = 512


def smollm2_weights(
    model: SmolLM2,
    *,
    prefix_tokens: int = PREFIX_TOKENS,
    continuation_tokens: int = CONTINUATION_TOKENS,
) -> list[Array]:
    """``[keys, values]`` weights ``[layers, kv_heads * head_dim]``, in one unit (KL per
    squared error): channel weights times layer sensitivities, on the first calibration text
    (never a test text)."""
    import torch

    from gateway.bench.end_to_end import PrefixContinuation
    from gateway.bench.kv_sensitivity import layer_sensitivity
    from serde.kvtc import weights

    text = texts("calibration")[0]
    ids = model.tokens(text.read(), prefix_tokens + continuation_tokens)
    kv, queries = model.capture(ids[:prefix_tokens])
    kv = kv.to(torch.float16)
    o_proj = torch.stack(
        [layer.self_attn.o_proj.weight.detach() for layer in model.model.model.layers]
    )
    channel = (
        weights.key_channel_weights(queries.numpy(), model.kv_heads, model.head_dim),
        weights.value_channel_weights(o_proj.float().numpy(), model.kv_heads, model.head_dim),
    )
    measure = PrefixContinuation(model, [kv], [ids[prefix_tokens:]])
    sensitivity = layer_sensitivity(measure, kv, channel, chunk_starts=[0])
    return [weights.with_layer_sensitivity(c, s) for c, s in zip(channel, sensitivity, strict=True)]
