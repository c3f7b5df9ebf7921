"""Attention: per-batch metadata, packed varlen prefill through SDPA, and paged decode backends.

Decode attention goes through `DecodeAttentionBackend` so the C++ CPU kernel (kernels/cpu) and
GPU kernels plug in behind one interface; `TorchPagedDecode` is the plain reference.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


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
    # the slots above and copied out layer by layer. (first prefill token, num_tokens, host blocks)
    cpu_prefills: tuple[tuple[int, int, tuple[int, ...]], ...] = ()
    slot_rows: torch.Tensor | None = None  # [num_slots] prefill tokens the slots are for; None: all

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


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int],
                      scale: float) -> torch.Tensor:
    """Causal attention over packed sequences, each through SDPA on its own tokens (no padding).

    q [num_tokens, num_heads, head_dim], k/v [num_tokens, kv_heads, head_dim] -> [num_tokens, num_heads, head_dim]
    """
    out = torch.empty_like(q)
    start = 0
    for length in seq_lens:
        end = start + length
        # SDPA wants [batch, heads, tokens, head_dim]
        out[start:end] = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1).unsqueeze(0),
            k[start:end].transpose(0, 1).unsqueeze(0),
            v[start:end].transpose(0, 1).unsqueeze(0),
            is_causal=True, scale=scale, enable_gqa=True,
        ).squeeze(0).transpose(0, 1)
        start = end
    return out


class DecodeAttentionBackend(ABC):
    """Attention of one new query token per sequence over its paged K/V."""

    name: str

    @abstractmethod
    def forward(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                new_key: torch.Tensor, new_value: torch.Tensor) -> torch.Tensor:
        """Append each sequence's new K/V at position context_len - 1 (fused, as Neo does), then attend.

        query [batch, num_heads, head_dim]; key_cache [blocks, kv_heads, head_dim, block_size] (keys
        transposed within a block); value_cache [blocks, kv_heads, block_size, head_dim];
        block_tables [batch, max_blocks] int32; context_lens [batch] int32 (with the new token);
        new_key/new_value [batch, kv_heads, head_dim] -> [batch, num_heads, head_dim]."""


class TorchPagedDecode(DecodeAttentionBackend):
    """Reference: gather each sequence's blocks, pad to the longest, masked softmax in fp32."""

    name = "torch"

    def forward(self, query, key_cache, value_cache, block_tables, context_lens, scale, new_key, new_value):
        batch, num_heads, head_dim = query.shape
        _, num_kv_heads, block_size, _ = value_cache.shape
        key_rows = key_cache.transpose(-1, -2)  # a view in the value layout; writes go through
        group = num_heads // num_kv_heads
        tables = block_tables.long()
        max_blocks = tables.shape[1]
        last = context_lens.long() - 1
        slot_blocks = tables.gather(1, (last // block_size)[:, None]).squeeze(1)
        key_rows[slot_blocks, :, last % block_size] = new_key
        value_cache[slot_blocks, :, last % block_size] = new_value

        def gather(cache: torch.Tensor) -> torch.Tensor:
            # [batch, max_blocks, kv_heads, block_size, head_dim] -> [batch, kv_heads, ctx, head_dim]
            return cache[tables].transpose(1, 2).reshape(batch, num_kv_heads, max_blocks * block_size, head_dim)

        keys, values = gather(key_rows).float(), gather(value_cache).float()
        q = query.float().view(batch, num_kv_heads, group, head_dim)
        scores = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [batch, kv_heads, group, ctx]
        positions = torch.arange(max_blocks * block_size, device=query.device)
        mask = positions[None, :] >= context_lens.long()[:, None]  # [batch, ctx]
        scores.masked_fill_(mask[:, None, None, :], float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), values)  # [batch, kv_heads, group, head_dim]
        return out.view(batch, num_heads, head_dim).to(query.dtype)


class CpuPagedDecode(DecodeAttentionBackend):
    """The C++ SIMD kernel of kernels/cpu: GQA-shared K/V reads, flash-decoding split over threads."""

    name = "cpu"
    # Inside the sequential forward, torch's own thread pool holds every core between ops and its
    # idle threads keep polling; a second pool fighting it made whole decode steps 1.6-2.4x slower
    # than running the kernel on the calling thread alone (SmolLM2, batch 8 fp32 and batch 32 bf16,
    # 2-core VM). More threads pay off only where the kernel has cores of its own (Neo's pipeline).
    IN_ENGINE_THREADS = 1

    def __init__(self, num_threads: int | None = IN_ENGINE_THREADS) -> None:
        from kernels import cpu

        if not cpu.is_available():
            raise RuntimeError(f"the CPU attention kernel is not built; run `make install` "
                               f"(or `{cpu.BUILD_COMMAND}`)")
        self._kernel = cpu.paged_decode_attention
        self.num_threads = num_threads

    def forward(self, query, key_cache, value_cache, block_tables, context_lens, scale, new_key, new_value):
        return self._kernel(query.contiguous(), key_cache, value_cache, block_tables, context_lens, scale,
                            new_key=new_key.contiguous(), new_value=new_value.contiguous(),
                            num_threads=self.num_threads)


_DECODE_BACKENDS: dict[str, Callable[[], DecodeAttentionBackend]] = {
    "torch": TorchPagedDecode,
    "cpu": CpuPagedDecode,
}


def register_decode_backend(name: str, factory: Callable[[], DecodeAttentionBackend]) -> None:
    _DECODE_BACKENDS[name] = factory


def default_decode_backend(device: str) -> str:
    """`auto`: the C++ kernel for KV on the CPU when it is built, else the torch reference."""
    if torch.device(device).type == "cpu":
        from kernels import cpu

        if cpu.is_available():
            return "cpu"
    return "torch"


def create_decode_backend(name: str, device: str = "cpu") -> DecodeAttentionBackend:
    if name == "auto":
        name = default_decode_backend(device)
    if name not in _DECODE_BACKENDS:
        raise ValueError(f"unknown decode attention backend {name!r}; known: {sorted(_DECODE_BACKENDS)}")
    return _DECODE_BACKENDS[name]()
