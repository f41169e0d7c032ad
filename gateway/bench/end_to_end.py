"""What a model makes of decoded K/V, end to end: decode a stored prefix, let the model read
on, and compare its next-token distributions with those it has on the exact prefix.

For each test text the model reads the continuation tokens (teacher forcing: the true next
tokens, not its own) on top of a cache holding the prefix's K/V. With the exact K/V (the
codec's input, in the stored dtype: so a lossless codec scores exactly 0) it gives reference
distributions P; with the decoded K/V, Q. Reported: KL(P || Q) in nats, averaged over every
continuation position of every text, and top-1 agreement, the share of positions where P and Q
have the same most likely token. Whatever the codec keeps exact (sink tokens, a recent window)
is its business: the measure only uses what it returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from gateway.bench.smollm2_sample import SmolLM2


class PrefixContinuation:
    """``measure(kv_hat)``: KL and top-1 agreement with the decoded prefixes ``kv_hat`` (the
    prefixes concatenated along tokens, as in the sample's ``kv``)."""

    def __init__(
        self,
        model: SmolLM2,
        prefixes: Sequence[torch.Tensor],
        continuations: Sequence[torch.Tensor],
    ) -> None:
        self.model = model
        self.continuations = list(continuations)
        self.lengths = [p.shape[2] for p in prefixes]
        # The reference, computed once: [positions, vocab] log-probabilities per text.
        self.reference = [
            model.continue_log_probs(p, ids)
            for p, ids in zip(prefixes, self.continuations, strict=True)
        ]

    def measure(self, kv_hat: torch.Tensor) -> tuple[float, float]:
        """(mean KL(exact || decoded) per position in nats, top-1 agreement in [0, 1])."""
        import torch

        if kv_hat.shape[2] != sum(self.lengths):
            raise ValueError(f"expected {sum(self.lengths)} tokens, got {kv_hat.shape[2]}")
        kl_sum, agree, positions = 0.0, 0, 0
        parts = torch.split(kv_hat, self.lengths, dim=2)
        for part, ids, ref in zip(parts, self.continuations, self.reference, strict=True):
            got = self.model.continue_log_probs(part, ids)
            kl = (ref.exp() * (ref - got)).sum(dim=-1)  # per position
            kl_sum += float(kl.sum())
            agree += int((ref.argmax(dim=-1) == got.argmax(dim=-1)).sum())
            positions += len(ids)
        # KL is never negative; rounding can make a near-zero one so by a hair.
        return max(kl_sum / positions, 0.0), agree / positions
