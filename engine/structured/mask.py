"""Holding each structured sequence's next token to its grammar: the grammar library fills a
packed bitmask row per constrained sequence on the host (bit set: allowed), and the logits of the
tokens it rules out become -inf on the logits' device. Unconstrained rows are not touched."""
from __future__ import annotations

import torch

from scheduler.sequence import Sequence

_BITS_PER_WORD = 32


def apply_token_masks(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """In place: row i of `logits` ([rows, vocab], row i is `seqs[i]`) keeps only what seqs[i]'s
    grammar allows next; rows without a grammar stay as they are."""
    rows = [i for i, seq in enumerate(seqs) if seq.grammar is not None]
    if not rows:
        return
    vocab_size = logits.shape[1]
    bitmask = allow_all_bitmask(len(rows), vocab_size)
    for mask_row, row in enumerate(rows):
        seqs[row].grammar.fill_mask(bitmask, mask_row)
    allowed = unpack_bitmask(bitmask.to(logits.device, non_blocking=True), vocab_size)
    row_index = torch.tensor(rows, device=logits.device)
    logits[row_index] = logits[row_index].masked_fill(~allowed, float("-inf"))


def allow_all_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """[num_rows, words] int32 with every token's bit set, for grammars to fill."""
    return torch.full((num_rows, -(-vocab_size // _BITS_PER_WORD)), -1, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab_size] bool; bit b of word w is token 32 * w + b."""
    shifts = torch.arange(_BITS_PER_WORD, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1  # an arithmetic shift, but only bit 0 is kept
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
