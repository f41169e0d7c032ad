"""How much a model's output moves per unit of error in each layer's keys or values.

For ``kvtc``'s weights (``serde.kvtc.weights``): per (plane, layer), noise that is white in the
layer's channel metric (variance ``sigma**2 / w_c`` in channel ``c``; sinks left exact, as
the codec keeps them) is added to the exact prefix K/V of a few texts, the model reads on
(``gateway.bench.end_to_end``), and the sensitivity is the mean KL divided by ``sigma**2``.
``sigma`` is ``relative_noise`` of the layer's weighted root mean square, small enough that KL
grows as the square of the error, as it does for a codec near KIVI-4's quality.

Cost: one continuation per (plane, layer) and text: 60 for SmolLM2 with one text, about a
minute on two cores.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from gateway.bench.end_to_end import PrefixContinuation

Array = np.ndarray[Any, Any]
RELATIVE_NOISE = 0.1
SINKS = 4


def layer_sensitivity(
    measure: PrefixContinuation,
    kv: Any,
    channel_weights: tuple[Array, Array],
    *,
    chunk_starts: list[int],
    relative_noise: float = RELATIVE_NOISE,
    seed: int = 0,
) -> Array:
    """``[2, layers]``: KL per unit of weighted squared error of keys (0) and values (1).

    ``kv`` is the exact prefix K/V the measure was built on (``[2, layers, tokens, C]``,
    texts concatenated along tokens); ``chunk_starts`` the token index where each text
    starts (its sinks stay exact); ``channel_weights`` the keys' and values' ``[layers, C]``.
    """
    import torch

    exact = kv.float()
    gen = torch.Generator().manual_seed(seed)
    layers = exact.shape[1]
    out = np.zeros((2, layers))
    for p in range(2):
        for layer in range(layers):
            w = torch.from_numpy(np.asarray(channel_weights[p][layer], np.float32))
            x = exact[p, layer]
            sigma = relative_noise * float(((x * x) * w).mean().sqrt())
            if sigma == 0.0:
                continue  # an all-zero layer: nothing to code, nothing to weigh
            noise = torch.randn(x.shape, generator=gen) * (sigma / w.sqrt())
            for start in chunk_starts:
                noise[start : start + SINKS] = 0
            noisy = exact.clone()
            noisy[p, layer] += noise
            kl, _ = measure.measure(noisy.to(kv.dtype))
            out[p, layer] = kl / sigma**2
    return out
