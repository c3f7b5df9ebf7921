"""Attention: per-batch metadata, packed varlen prefill, and paged decode backends + registry."""
from engine.attention.decode import (
    CpuPagedDecode,
    DecodeAttentionBackend,
    TorchPagedDecode,
    create_decode_backend,
    default_decode_backend,
    register_decode_backend,
)
from engine.attention.metadata import AttentionMetadata, CpuDecodeMetadata
from engine.attention.prefill import prefill_attention

__all__ = ["AttentionMetadata", "CpuDecodeMetadata", "CpuPagedDecode", "DecodeAttentionBackend",
           "TorchPagedDecode", "create_decode_backend", "default_decode_backend", "prefill_attention",
           "register_decode_backend"]
