"""Static rANS over many independent streams, in plain torch: the executable spec of the coder.

Each stream is coded on its own (``gpu.cpu.rans`` loops over streams, ``gpu.cuda.cachegen``
runs one stream per thread); here all streams advance in lockstep, one symbol position per
step, with tensor operations over streams, so the spec is also usable on real sizes.

The coder (Fabian Giesen's rANS with a 32-bit state and 16-bit words), integer arithmetic
only, so every implementation writes the same words:

- frequencies ``f`` and cumulative starts ``c`` of every symbol sum to ``2**PREC`` per table;
  a symbol with ``f == 0`` must not occur;
- the state ``x`` lives in ``[L, 2**32)`` with ``L = 2**16``; encoding runs backwards over the
  stream's symbols: if ``x >= f << (32 - PREC)`` emit ``x & 0xffff`` and ``x >>= 16``; then
  ``x = (x // f << PREC) + x % f + c``. At the end emit the low then the high half of ``x``.
  Words are emitted from the end of the stream backwards, so the stream reads forwards;
- decoding starts from ``x = high << 16 | low`` (the first two words): ``slot = x & (2**PREC
  - 1)``, the symbol ``s`` whose range holds ``slot``, ``x = f * (x >> PREC) + slot - c``,
  and if ``x < L`` read the next word: ``x = x << 16 | word``;
- a stream decodes correctly only if it ends in state ``L`` with every word read: anything
  else (a read past the stream, a leftover word, another final state) marks it corrupt. The
  state stays below ``2**32`` whatever the words, and the loop runs a fixed number of steps.
"""

from __future__ import annotations

import torch

from serde.cachegen.tables import PREC

RANS_L = 1 << 16
WORD_BITS = 16
WORD_MASK = (1 << WORD_BITS) - 1
SLOT_MASK = (1 << PREC) - 1


def encode(
    sym: torch.Tensor,
    tbl: torch.Tensor,
    count: torch.Tensor,
    freq: torch.Tensor,
    cum: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode ``count[s]`` symbols ``sym[s, :count[s]]`` (indices) of every stream ``s`` with
    tables ``tbl[s, i]`` (rows of ``freq``/``cum``). Returns ``(words, lengths)``: the streams'
    16-bit words (int32) one stream after the other, and each stream's word count."""
    streams, width = sym.shape
    dev = sym.device
    cap = width + 2
    buf = torch.zeros((streams, cap), dtype=torch.int32, device=dev)
    pos = torch.full((streams,), cap, dtype=torch.int64, device=dev)
    x = torch.full((streams,), RANS_L, dtype=torch.int64, device=dev)
    rows = torch.arange(streams, device=dev)
    freq64, cum64 = freq.long(), cum.long()
    for i in range(width - 1, -1, -1):
        active = count > i
        t = torch.where(active, tbl[:, i], 0)
        s = torch.where(active, sym[:, i], 0)
        f = torch.where(active, freq64[t, s], 1)
        c = cum64[t, s]
        out = active & (x >= (f << (32 - PREC)))
        pos = pos - out.long()
        buf[rows[out], pos[out]] = (x[out] & WORD_MASK).int()
        x = torch.where(out, x >> WORD_BITS, x)
        x = torch.where(active, ((x // f) << PREC) + x % f + c, x)
    for part in (x & WORD_MASK, x >> WORD_BITS):
        pos = pos - 1
        buf[rows, pos] = part.int()
    keep = torch.arange(cap, device=dev)[None, :] >= pos[:, None]
    return buf[keep], cap - pos


class Decoder:
    """The decoders of all streams, stepped together (``get`` decodes one symbol of each)."""

    def __init__(self, words: torch.Tensor, offsets: torch.Tensor) -> None:
        self.words = words.long()
        self.pos = offsets[:-1].long().clone()
        self.end = offsets[1:].long()
        self.ok = (self.end - self.pos) >= 2
        everyone = torch.ones_like(self.ok)
        high = self._read(everyone)
        self.x = (high << WORD_BITS) | self._read(everyone)

    def _read(self, mask: torch.Tensor) -> torch.Tensor:
        """The next word of every stream in ``mask`` (0 where the stream has run out)."""
        inside = self.pos < self.end
        self.ok &= ~mask | inside
        take = mask & inside
        idx = torch.where(take, self.pos, 0).clamp_max(max(self.words.numel() - 1, 0))
        word = self.words[idx] if self.words.numel() else torch.zeros_like(idx)
        self.pos = self.pos + take.long()
        return torch.where(take, word, 0)

    def get(
        self,
        tbl: torch.Tensor,
        active: torch.Tensor,
        freq: torch.Tensor,
        cum: torch.Tensor,
        lut: torch.Tensor,
    ) -> torch.Tensor:
        """Decode one symbol index from every ``active`` stream with its table ``tbl`` (a row
        of the tables, ``-1`` = no such table: the stream is corrupt)."""
        self.ok &= ~active | (tbl >= 0)
        t = tbl.clamp_min(0)
        slot = self.x & SLOT_MASK
        s = lut[t, slot].long()
        f = freq[t, s].long()
        c = cum[t, s].long()
        x = torch.where(active, f * (self.x >> PREC) + slot - c, self.x)
        need = active & (x < RANS_L)
        self.x = torch.where(need, (x << WORD_BITS) | self._read(need), x)
        return s

    def finish(self) -> torch.Tensor:
        """Which streams decoded cleanly (final state ``L``, every word used)."""
        return self.ok & (self.x == RANS_L) & (self.pos == self.end)


def decode(
    words: torch.Tensor,
    offsets: torch.Tensor,
    tbl: torch.Tensor,
    count: torch.Tensor,
    freq: torch.Tensor,
    cum: torch.Tensor,
    lut: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode ``count[s]`` symbols of every stream with known tables ``tbl[s, i]``; returns
    ``(sym [streams, width], ok [streams])`` (the inverse of ``encode``)."""
    dec = Decoder(words, offsets)
    sym = torch.zeros(tbl.shape, dtype=torch.int64, device=tbl.device)
    for i in range(tbl.shape[1]):
        active = count > i
        sym[:, i] = dec.get(torch.where(active, tbl[:, i], 0), active, freq, cum, lut)
    return sym, dec.finish()
