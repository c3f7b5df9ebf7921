"""Per-batch attention metadata, built by the runner and passed explicitly (no globals)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrefillPrefix:
    """A prefill chunk that attends to KV already cached: its sequence's first `num_cached_tokens`
    tokens, in `block_ids` of the GPU pool or (`on_cpu`) the host pool."""

    index: int  # which prefill of the batch
    num_cached_tokens: int
    block_ids: tuple[int, ...]
    on_cpu: bool


@dataclass
class AttentionMetadata:
    """Everything attention needs about one packed batch: prefill tokens first, then one token
    per decoding sequence. Built by the runner, passed explicitly (no globals)."""

    prefill_seq_lens: list[int]  # tokens of each prefill sequence, in batch order
    num_prefill_tokens: int
    # where each prefill token's K/V goes; decode tokens are appended by the decode backend
    slot_blocks: torch.Tensor  # [num_prefill_tokens] int64: block
    slot_offsets: torch.Tensor  # [num_prefill_tokens] int64: offset inside that block
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int32
    decode_context_lens: torch.Tensor | None  # [num_decodes] int32, including the new token
    # Prefills bound for the host pool (Neo: CPU-requests from birth): their tokens are left out of
    # the slots above and copied out layer by layer.
    # (first prefill row, num_tokens, position of the first, host blocks from position 0)
    cpu_prefills: tuple[tuple[int, int, int, tuple[int, ...]], ...] = ()
    slot_rows: torch.Tensor | None = None  # [num_slots] prefill tokens the slots are for; None: all
    # chunks after the first (chunked prefill) and prompts after a cached prefix
    prefill_prefixes: tuple[PrefillPrefix, ...] = ()

    @property
    def num_decodes(self) -> int:
        return 0 if self.decode_context_lens is None else int(self.decode_context_lens.shape[0])


@dataclass
class CpuDecodeMetadata:
    """Decode rows whose K/V lives in the host pool; their attention runs on the CPU."""

    block_tables: torch.Tensor  # [num_cpu_decodes, max_blocks] int32, host pool blocks
    context_lens: torch.Tensor  # [num_cpu_decodes] int32 (with the new token), on the host

    @property
    def num_decodes(self) -> int:
        return int(self.context_lens.shape[0])
