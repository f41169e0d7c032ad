"""Keeping a transformers decoder's post-RoPE queries, keys and values as it runs.

transformers calls the attention function registered under a model's ``attn_implementation``
with the queries and keys after RoPE and the keys and values after the cache update: exactly
what a KV cache holds and what attention sees. ``ATTENTION`` is such a function: it hands them
to the ``Recorder`` that is recording (if any), then runs transformers' own SDPA attention, so
the model computes what it computes with ``sdpa``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ATTENTION = "kvgate_capture"


class Recorder:
    """Per layer, the last forward's Q ``[heads, tokens, head_dim]`` and K, V ``[kv_heads,
    tokens, head_dim]`` (batch 1, float32, on the CPU). K and V span the cache too when the
    forward ran on one."""

    def __init__(self) -> None:
        self.queries: dict[int, torch.Tensor] = {}
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    @contextlib.contextmanager
    def recording(self) -> Iterator[Recorder]:
        self.queries.clear()
        self.keys.clear()
        self.values.clear()
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    def keep(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if q.shape[0] != 1:
            raise ValueError("the recorder keeps batch 1 only")
        self.queries[layer] = q[0].detach().float().clone()
        self.keys[layer] = k[0].detach().float().clone()
        self.values[layer] = v[0].detach().float().clone()


_ACTIVE: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar(
    "kvgate_recorder", default=None
)


def _attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (recorder := _ACTIVE.get()) is not None:
        recorder.keep(int(module.layer_idx), query, key, value)
    out: tuple[torch.Tensor, torch.Tensor | None] = sdpa_attention_forward(
        module, query, key, value, attention_mask, **kwargs
    )
    return out


def register() -> None:
    """Make ``ATTENTION`` a name ``from_pretrained(attn_implementation=...)`` accepts, and
    give it SDPA's attention mask (a name transformers does not know gets no mask at all)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTENTION, _attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)
