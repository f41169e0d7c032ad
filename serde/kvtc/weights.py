"""Where an error in K or V costs: per-element weights for a ``kvtc`` calibration.

``serde.kvtc.fit`` spends one uniform step in a weighted metric, so every unit of *weighted*
squared error gets the same bits (reverse water-filling). Weighting by what the model does
with each element moves bits to where an error shows end to end:

- **keys** reach the model only through ``q . k``: an error in channel ``c`` of a KV head
  costs, in the attention logits, the energy ``E[q_c**2]`` of the query heads that read that
  KV head (grouped-query attention: several). RoPE turns each pair ``(i, i + head_dim/2)`` of
  ``q`` and ``k`` by the same angle, so a pair's weight is the mean of its two channels':
  the same for keys with RoPE undone and for keys as stored;
- **values** reach the layer's output through ``o_proj``: channel ``c`` of a KV head costs
  the squared norm of the ``o_proj`` columns of the query heads that read it;
- **layers** differ by orders of magnitude in how much the model's output moves for the same
  error. Within a layer the channel weights above are normalized to mean 1, and the layer as
  a whole gets its measured sensitivity (KL per unit of weighted squared error, from adding
  noise to one layer's keys or values and letting the model read on:
  ``gateway.bench.kv_sensitivity``). Keys and values are then in one unit, so they share one
  step (``fit(..., shared_step=True)``).

Measured on SmolLM2-135M (README, ``kvtc``): unweighted, one PCA per 3 layers stored 5.7x at
KIVI-4's end-to-end KL; with these weights, 7.9x (10.2x at twice that KL).
"""

from __future__ import annotations

from typing import Any

import numpy as np

Array = np.ndarray[Any, Any]


def _per_kv_head(energy: Array, heads: int, kv_heads: int, head_dim: int) -> Array:
    """``[layers, heads * head_dim]`` per query head channel to ``[layers, kv_heads *
    head_dim]``: the sum over the query heads that read each KV head."""
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} KV heads evenly")
    layers = energy.shape[0]
    per = energy.reshape(layers, kv_heads, heads // kv_heads, head_dim).sum(axis=2)
    out: Array = per.reshape(layers, kv_heads * head_dim)
    return out


def key_channel_weights(queries: Array, kv_heads: int, head_dim: int) -> Array:
    """Keys' channel weights ``[layers, kv_heads * head_dim]`` from queries ``[layers,
    tokens, heads * head_dim]`` (post-RoPE or not: pairs are averaged), each layer's mean 1."""
    q = np.asarray(queries, np.float64)
    if q.ndim != 3 or q.shape[2] % head_dim or head_dim % 2:
        raise ValueError("queries must be [layers, tokens, heads * head_dim], head_dim even")
    heads = q.shape[2] // head_dim
    energy = _per_kv_head((q * q).mean(axis=1), heads, kv_heads, head_dim)
    layers = energy.shape[0]
    half = head_dim // 2
    pairs = energy.reshape(layers, kv_heads, 2, half).mean(axis=2, keepdims=True)
    both = np.broadcast_to(pairs, (layers, kv_heads, 2, half)).reshape(layers, -1)
    return per_layer_normalized(both)


def value_channel_weights(o_proj: Array, kv_heads: int, head_dim: int) -> Array:
    """Values' channel weights ``[layers, kv_heads * head_dim]`` from the output projections
    ``[layers, hidden, heads * head_dim]``, each layer's mean 1."""
    w = np.asarray(o_proj, np.float64)
    if w.ndim != 3 or w.shape[2] % head_dim:
        raise ValueError("o_proj must be [layers, hidden, heads * head_dim]")
    energy = _per_kv_head((w * w).sum(axis=1), w.shape[2] // head_dim, kv_heads, head_dim)
    return per_layer_normalized(energy)


def per_layer_normalized(weights: Array) -> Array:
    """Each layer's weights scaled to mean 1 (a floor keeps every weight positive)."""
    w = np.asarray(weights, np.float64)
    w = w / np.maximum(w.mean(axis=1, keepdims=True), 1e-300)
    out: Array = np.maximum(w, 1e-6)
    return out


def with_layer_sensitivity(channel: Array, sensitivity: Array) -> Array:
    """``channel`` ``[layers, C]`` times each layer's ``sensitivity`` ``[layers]`` (floored
    at a millionth of the largest, so that no layer is free)."""
    s = np.asarray(sensitivity, np.float64)
    if s.shape != (channel.shape[0],) or not np.isfinite(s).all():
        raise ValueError("one finite sensitivity per layer")
    s = np.maximum(s, max(float(s.max()), 1e-300) * 1e-6)
    out: Array = channel * s[:, None]
    return out
