"""The model runner: owns every tensor (weights, KV cache) and executes an IterationPlan."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata, create_decode_backend
from engine.config import ModelConfig
from engine.kv_cache import KVCache
from engine.model import LlamaModel
from engine.sampler import Sampler, SamplerOutput
from engine.weights import WeightLoader
from scheduler.scheduler import IterationPlan


@dataclass
class RunnerOutput:
    """One sampled token per scheduled sequence, in plan order (prefills, then decodes)."""

    sampled: SamplerOutput

    @property
    def sampled_token_ids(self) -> list[int]:
        return self.sampled.token_ids


class ModelRunner:
    def __init__(self, config: ModelConfig, loader: WeightLoader, *, dtype: torch.dtype,
                 device: str, num_blocks: int, block_size: int, max_model_len: int,
                 decode_backend: str = "auto", seed: int | None = None, show_progress: bool = False) -> None:
        self.config = config
        self.device = torch.device(device)
        self.block_size = block_size
        self.model = LlamaModel(config, loader, dtype, self.device, max_model_len,
                                create_decode_backend(decode_backend, device), show_progress=show_progress)
        self.kv_cache = KVCache(config, num_blocks, block_size, dtype, self.device)
        self.sampler = Sampler(config.vocab_size, seed=seed)

    @torch.inference_mode()
    def execute(self, plan: IterationPlan) -> RunnerOutput:
        logits = self.compute_logits(plan)
        return RunnerOutput(self.sampler(logits, [s.request for s in plan.scheduled]))

    @torch.inference_mode()
    def compute_logits(self, plan: IterationPlan) -> torch.Tensor:
        """Run the model over the plan's packed batch. -> [num_scheduled, vocab] fp32"""
        token_ids, positions, slots = [], [], []
        last_indices, prefill_seq_lens = [], []
        block_size = self.block_size
        for seq in plan.scheduled:
            start, count = seq.num_computed_tokens, seq.num_new_tokens
            token_ids.extend(seq.token_ids)
            positions.extend(range(start, start + count))
            last_indices.append(len(token_ids) - 1)
        for seq in plan.prefills:
            prefill_seq_lens.append(seq.num_new_tokens)
            table, start = seq.request.block_ids, seq.num_computed_tokens
            slots.extend(table[p // block_size] * block_size + p % block_size
                         for p in range(start, start + seq.num_new_tokens))

        device = self.device
        slot_tensor = torch.tensor(slots, dtype=torch.int64)
        block_tables = context_lens = None
        if plan.decodes:
            max_blocks = max(len(s.request.block_ids) for s in plan.decodes)
            # unused entries point at block 0; context_lens masks them out
            block_tables = torch.tensor(
                [s.request.block_ids + [0] * (max_blocks - len(s.request.block_ids)) for s in plan.decodes],
                dtype=torch.int32, device=device)
            context_lens = torch.tensor([s.num_computed_tokens + 1 for s in plan.decodes],
                                        dtype=torch.int32, device=device)
        meta = AttentionMetadata(
            prefill_seq_lens=prefill_seq_lens,
            num_prefill_tokens=sum(prefill_seq_lens),
            slot_blocks=(slot_tensor // block_size).to(device),
            slot_offsets=(slot_tensor % block_size).to(device),
            decode_block_tables=block_tables,
            decode_context_lens=context_lens,
        )
        return self.model.forward(
            torch.tensor(token_ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            self.kv_cache, meta,
            torch.tensor(last_indices, dtype=torch.int64, device=device),
        )
