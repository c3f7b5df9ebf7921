"""Packing a plan's sub-batch into flat tensors plus the attention metadata the model reads."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata, CpuDecodeMetadata
from engine.attention.metadata import PrefillPrefix
from scheduler.block_pool import blocks_for
from scheduler.sequence import Tier
from scheduler.iteration_plan import ScheduledSeq


@dataclass
class BatchInputs:
    """One sub-batch: GPU rows (prefills, GPU decodes) then CPU decode rows."""

    token_ids: torch.Tensor  # [num_tokens] on the GPU
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata  # the GPU rows
    cpu: CpuDecodeMetadata | None  # the trailing CPU decode rows
    # each sequence's output rows, in order: its last token's; every row of a verify share
    sequence_rows: torch.Tensor
    # Prefills that asked for prompt logprobs: the rows whose logits predict their prompt's next
    # tokens ([num_prompt_rows], after `sequence_rows` in the forward's output), and per such
    # prefill (its index among this batch's sequences, its number of rows), in row order.
    prompt_rows: torch.Tensor
    prompt_spans: list[tuple[int, int]]

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_gpu_rows(self) -> int:
        return self.meta.num_prefill_tokens + self.meta.num_decodes


def build_batch(prefills: list[ScheduledSeq], gpu_decodes: list[ScheduledSeq], cpu_decodes: list[ScheduledSeq],
                block_size: int, device: torch.device) -> BatchInputs:
    """Pack one sub-batch: prefill tokens, then GPU decodes, then CPU decodes."""
    token_ids, positions, sequence_rows, prompt_rows, prompt_spans = [], [], [], [], []
    for index, seq in enumerate((*prefills, *gpu_decodes, *cpu_decodes)):
        start, count = seq.num_computed_tokens, seq.num_new_tokens
        if index < len(prefills) and seq.sequence.wants_prompt_logprobs:
            first, end = prompt_logprob_positions(seq)
            prompt_rows.extend(range(len(token_ids) + first - start, len(token_ids) + end - start))
            prompt_spans.append((index, end - first))
        token_ids.extend(seq.token_ids)
        positions.extend(range(start, start + count))
        sequence_rows.extend(range(len(token_ids) - seq.num_output_rows, len(token_ids)))
    cpu_meta = None
    if cpu_decodes:
        cpu_meta = CpuDecodeMetadata(*_decode_tables(cpu_decodes, torch.device("cpu")))
    return BatchInputs(
        token_ids=torch.tensor(token_ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        meta=_gpu_metadata(prefills, gpu_decodes, block_size, device), cpu=cpu_meta,
        sequence_rows=torch.tensor(sequence_rows, dtype=torch.int64, device=device),
        prompt_rows=torch.tensor(prompt_rows, dtype=torch.int64, device=device), prompt_spans=prompt_spans,
    )


def prompt_logprob_positions(seq: ScheduledSeq) -> tuple[int, int]:
    """The positions [first, end) of a prefill chunk whose logits give prompt logprobs: each
    predicts the prompt token after it, so the prompt's last position gives none, and positions
    an earlier run already scored (before a preemption) give none again."""
    start = max(seq.num_computed_tokens, seq.sequence.num_prompt_logprob_rows)
    end = min(seq.num_computed_tokens + seq.num_new_tokens, seq.sequence.num_prompt_tokens - 1)
    return start, max(start, end)


def _gpu_metadata(prefills: list[ScheduledSeq], gpu_decodes: list[ScheduledSeq], block_size: int,
                          device: torch.device) -> AttentionMetadata:
    """Where each prefill token's K/V goes (GPU slots, or a host-pool copy-out), the cached
    prefixes chunks attend to, and the GPU decodes' block tables."""
    slots, slot_rows, cpu_prefills, prefill_seq_lens, prefixes = [], [], [], [], []
    row = 0
    for index, seq in enumerate(prefills):
        table, start, count = seq.sequence.block_ids, seq.num_computed_tokens, seq.num_new_tokens
        prefill_seq_lens.append(count)
        on_cpu = seq.sequence.tier is Tier.CPU
        if start:
            prefixes.append(PrefillPrefix(index, start, tuple(table[:blocks_for(start, block_size)]), on_cpu))
        if on_cpu:
            cpu_prefills.append((row, count, start, tuple(table)))
        else:
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, start + count))
            slot_rows.extend(range(row, row + count))
        row += count
    slot_tensor = torch.tensor(slots, dtype=torch.int64)
    block_tables, context_lens = _decode_tables(gpu_decodes, device)
    return AttentionMetadata(
        prefill_seq_lens=prefill_seq_lens,
        num_prefill_tokens=row,
        slot_blocks=(slot_tensor // block_size).to(device),
        slot_offsets=(slot_tensor % block_size).to(device),
        decode_block_tables=block_tables,
        decode_context_lens=context_lens,
        cpu_prefills=tuple(cpu_prefills),
        slot_rows=torch.tensor(slot_rows, dtype=torch.int64, device=device) if cpu_prefills else None,
        prefill_prefixes=tuple(prefixes),
    )


def _decode_tables(decodes: list[ScheduledSeq], device: torch.device):
    """-> block tables [num_decode_rows, max_blocks] int32 (unused entries point at block 0 and are
    masked by the context lengths) and context lengths [num_decode_rows] int32; (None, None) if
    empty. A verify share is one row per token, each a decode of its own position: every backend
    appends a step's new K/V before it attends, so each row reads the drafts before it."""
    if not decodes:
        return None, None
    rows = [(s.sequence.block_ids, s.num_computed_tokens + offset + 1)
            for s in decodes for offset in range(s.num_new_tokens)]
    max_blocks = max(len(table) for table, _ in rows)
    tables = torch.tensor([table + [0] * (max_blocks - len(table)) for table, _ in rows],
                          dtype=torch.int32, device=device)
    context_lens = torch.tensor([context_len for _, context_len in rows], dtype=torch.int32, device=device)
    return tables, context_lens
