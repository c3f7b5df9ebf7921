"""Paged decode attention: one new query token per sequence over its paged K/V.

Backends plug in behind `DecodeAttentionBackend` and a name registry: `torch` is the plain
reference, `cpu` the C++ SIMD kernel of kernels/cpu, `triton` kernels/triton's for KV on CUDA.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
import importlib.util
from typing import Callable

import torch

from engine.kv.layouts import KVLayout, create_layout
from engine.registry import Registry


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


def dense_layout_of(key_cache: torch.Tensor, value_cache: torch.Tensor) -> KVLayout:
    """The layout of 16-bit or fp32 pools, read off their shapes (value_cache [blocks, kv_heads,
    block_size, head_dim])."""
    _, num_kv_heads, block_size, head_dim = value_cache.shape
    return create_layout("auto", value_cache.dtype, num_kv_heads, head_dim, block_size)


def new_token_slots(block_tables: torch.Tensor, context_lens: torch.Tensor,
                    block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's slot at context_len - 1: (block, offset) [batch] int64, on the tables' device."""
    last = context_lens.long() - 1
    return block_tables.long().gather(1, (last // block_size)[:, None]).squeeze(1), last % block_size


def append_new_tokens(key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                      context_lens: torch.Tensor, new_key: torch.Tensor, new_value: torch.Tensor,
                      layout: KVLayout | None = None) -> None:
    """Each sequence's new K/V [batch, kv_heads, head_dim] into its slot at context_len - 1, by
    indexed stores on the caches' device (no host sync). `layout`: the pools' (None: dense)."""
    layout = layout or dense_layout_of(key_cache, value_cache)
    blocks, offsets = new_token_slots(block_tables, context_lens, layout.block_size)
    layout.write(key_cache, value_cache, new_key, new_value, blocks, offsets)


def quantized_format_args(kv_layout: KVLayout | None) -> dict:
    """The kernels' keywords for pools of a quantized format (whose shape does not give the block
    size); none for dense pools."""
    if kv_layout is None or not kv_layout.format.quantized:
        return {}
    return {"kv_format": kv_layout.format.name, "block_size": kv_layout.block_size}


class TorchPagedDecode(DecodeAttentionBackend):
    """Reference: gather each sequence's blocks (dequantized), pad to the longest, masked softmax in fp32."""

    name = "torch"

    def __init__(self, kv_layout: KVLayout | None = None) -> None:
        self.kv_layout = kv_layout  # None: dense pools, read off the tensors

    def forward(self, query, key_cache, value_cache, block_tables, context_lens, scale, new_key, new_value):
        batch, num_heads, head_dim = query.shape
        layout = self.kv_layout or dense_layout_of(key_cache, value_cache)
        append_new_tokens(key_cache, value_cache, block_tables, context_lens, new_key, new_value, layout)
        num_kv_heads = key_cache.shape[1]
        group = num_heads // num_kv_heads
        tables = block_tables.long()
        max_blocks = tables.shape[1]

        def gather(cache: torch.Tensor, is_key: bool) -> torch.Tensor:
            # [batch * max_blocks, kv_heads, block_size, head_dim] -> [batch, kv_heads, ctx, head_dim]
            rows = layout.read_blocks(cache, tables.flatten(), is_key).float()
            return rows.view(batch, max_blocks, *rows.shape[1:]).transpose(1, 2).reshape(
                batch, num_kv_heads, -1, head_dim)

        keys, values = gather(key_cache, True), gather(value_cache, False)
        q = query.float().view(batch, num_kv_heads, group, head_dim)
        scores = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [batch, kv_heads, group, ctx]
        positions = torch.arange(keys.shape[2], device=query.device)
        mask = positions[None, :] >= context_lens.long()[:, None]  # [batch, ctx]
        scores.masked_fill_(mask[:, None, None, :], float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), values)  # [batch, kv_heads, group, head_dim]
        return out.view(batch, num_heads, head_dim).to(query.dtype)


class CpuPagedDecode(DecodeAttentionBackend):
    """The C++ SIMD kernel of kernels/cpu: GQA-shared K/V reads, flash-decoding split over threads."""

    name = "cpu"
    # Inside the sequential forward torch's thread pool holds every core between ops, and a second
    # pool fighting it slows whole decode steps (docs/benchmarks.md, "Measurements behind code
    # choices"); more threads pay off only where the kernel has cores of its own (Neo's pipeline).
    IN_ENGINE_THREADS = 1

    def __init__(self, num_threads: int | None = IN_ENGINE_THREADS, kv_layout: KVLayout | None = None) -> None:
        from kernels import cpu

        if not cpu.is_available():
            raise RuntimeError(f"the CPU attention kernel is not built; run `make install` "
                               f"(or `{cpu.BUILD_COMMAND}`)")
        self._kernel = cpu.paged_decode_attention
        self.num_threads = num_threads
        self._format_args = quantized_format_args(kv_layout)

    def forward(self, query, key_cache, value_cache, block_tables, context_lens, scale, new_key, new_value):
        if not self._format_args:  # dense pools take the new K/V in their own dtype
            new_key, new_value = new_key.to(key_cache.dtype), new_value.to(value_cache.dtype)
        return self._kernel(query.contiguous(), key_cache, value_cache, block_tables, context_lens, scale,
                            new_key=new_key.contiguous(), new_value=new_value.contiguous(),
                            num_threads=self.num_threads, **self._format_args)


class TritonPagedDecode(DecodeAttentionBackend):
    """kernels/triton's paged decode attention (CUDA; CPU tensors under Triton's interpreter):
    the new tokens' K/V stored by indexed writes, then one program per (sequence, KV head).
    With a quantized layout the caches are group-quantized pools (kernels/kv_quant.py): the new
    tokens are quantized into them by the layout's write, and the attention dequantizes the codes
    as it reads them."""

    name = "triton"

    def __init__(self, kv_layout: KVLayout | None = None) -> None:
        import importlib  # noqa: F811

        self.kv_layout = kv_layout  # None: dense pools, read off the tensors
        self._format_args = quantized_format_args(kv_layout)
        # by name, so that a test's interpreted import of the module is the one used
        self._kernels = importlib.import_module("kernels.triton.paged_decode")

    def forward(self, query, key_cache, value_cache, block_tables, context_lens, scale, new_key, new_value):
        # a quantized CUDA pool's layout writes through kernels/triton/kv_quant_write.py
        append_new_tokens(key_cache, value_cache, block_tables, context_lens, new_key, new_value, self.kv_layout)
        return self._kernels.paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens,
                                                    scale, **self._format_args)


DECODE_BACKENDS: Registry[DecodeAttentionBackend] = Registry("decode attention backend")
DECODE_BACKENDS.register("torch")(TorchPagedDecode)
DECODE_BACKENDS.register("cpu")(CpuPagedDecode)
DECODE_BACKENDS.register("triton")(TritonPagedDecode)


def register_decode_backend(name: str, factory: Callable[[], DecodeAttentionBackend]) -> None:
    DECODE_BACKENDS.register(name)(factory)


def default_decode_backend(device: str) -> str:
    """`auto`: the C++ kernel for KV on the CPU when it is built, the Triton kernel for KV on CUDA
    when triton imports, else the torch reference."""
    device_type = torch.device(device).type
    if device_type == "cpu":
        from kernels import cpu

        if cpu.is_available():
            return "cpu"
    if device_type == "cuda" and importlib.util.find_spec("triton") is not None:
        return "triton"
    return "torch"


def create_decode_backend(name: str, device: str = "cpu", kv_layout: KVLayout | None = None) -> DecodeAttentionBackend:
    """Backend `name` (auto: default_decode_backend) reading pools of `kv_layout` (None: dense)."""
    if name == "auto":
        name = default_decode_backend(device)
    return DECODE_BACKENDS.create(name, kv_layout=kv_layout)
