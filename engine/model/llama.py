"""The Llama family (Llama 2/3/3.1, Mistral, Qwen2, SmolLM) as explicit stages.

`pre_layer` (embed) -> per layer `pre_proj` (norm, QKV, RoPE) -> `attention` -> `post_proj`
(O-proj, residual, norm, SwiGLU MLP) -> `post_layer` (final norm, LM head on the last position
of each sequence). The sequential `forward` strings them together; later pipelines interleave
two sub-batches stage by stage with the very same functions.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging

import torch
import torch.nn.functional as F
from tqdm import tqdm

from engine.attention import AttentionMetadata, DecodeAttentionBackend, prefill_attention
from engine.attention.prefill import paged_prefill, rowwise_prefill
from engine.attention.decode import CpuPagedDecode, quantized_format_args
from engine.config import CpuOps
from engine.kv import TwoTierKVCache
from engine.model_config import ModelConfig
from engine.model.layer_store import LayerStore
from engine.model.layers import RotaryEmbedding, fused_rms_norm, fused_silu_mul, rms_norm, silu_mul
from engine.model.native import NativeDecoder, NotNative
from engine.model.registry import register_model
from engine.quant import LinearMethod, create_linear_method
from engine.weights import WeightLoader
from kernels import cpu as cpu_kernels
from scheduler.planning.tiers import Tier

logger = logging.getLogger(__name__)




def _paged_prefill_kernels(device: torch.device):
    if device.type != "cuda" or importlib.util.find_spec("triton") is None:
        return None
    return importlib.import_module("kernels.triton.paged_prefill")


@register_model("llama")
@register_model("mistral")
@register_model("qwen2")
class LlamaModel:
    # the decode forward launches GPU work only, none that waits on the host: CUDA graphs may record it
    graph_capturable = True

    def __init__(self, config: ModelConfig, loader: WeightLoader, dtype: torch.dtype,
                 device: torch.device | str, max_model_len: int, decode_backend: DecodeAttentionBackend,
                 show_progress: bool = False, linear_method: LinearMethod | None = None,
                 cpu_ops: CpuOps = CpuOps.LAYERS, layer_store: LayerStore | None = None,
                 batch_invariant: bool = False) -> None:
        """`batch_invariant`: prompt rows through decode's kernels (engine/config.py's --batch-invariant)."""
        self.config = config
        # the RMSNorms, RoPE and SwiGLU's silu(gate) * up in one C++ call each where the kernels apply, or as torch ops
        fused = cpu_ops != CpuOps.TORCH
        self.rms_norm = fused_rms_norm if fused else rms_norm
        self.silu_mul = fused_silu_mul if fused else silu_mul
        self.dtype = dtype
        self.device = torch.device(device)
        self.decode_backend = decode_backend
        # kernels/triton/paged_prefill.py on CUDA (chunks read their cached prefix in place); None: gather + SDPA
        self.paged_prefill_kernels = _paged_prefill_kernels(self.device)
        # each prompt row attended as its decode would be (kernels/cpu's decode kernel); None: chunk-wise
        self.rowwise_prefill_kernel = cpu_kernels.paged_decode_attention if batch_invariant else None
        self.scale = config.head_dim ** -0.5
        self.linear_method = linear_method or create_linear_method("dense")

        globals_ = {k: v.to(self.device) for k, v in loader.load_globals(dtype).items()}
        self.embed_tokens = globals_["embed_tokens"]  # [vocab, hidden]
        self.final_norm = globals_["norm"]
        head = self.embed_tokens if config.tie_word_embeddings else globals_["lm_head"]
        self.layer_store = layer_store or LayerStore(self.device)
        # the LM head stays dense like the embeddings: quantization is for the decoder layers
        self.lm_head = self.layer_store.head(create_linear_method("dense", row_invariant=batch_invariant).create_weight(
            head, None, dtype=dtype, device=self.device))
        load_layer = loader.load_layer_packed if self.linear_method.takes_packed_int4 else loader.load_layer
        self.layers = [
            self._build_layer(i, load_layer(i, dtype))
            for i in tqdm(range(config.num_layers), desc="loading layers", unit="layer", disable=not show_progress)
        ]
        self.layer_store.start()
        self.rope = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling, max_model_len,
                                    self.device, fused=fused)
        # decode-sized stages (and whole decode steps) in one C++ call: engine/model/native.py
        # (only over weights that stay where they were loaded: streamed layers come and go)
        self.native = self._native_decoder() if cpu_ops == CpuOps.LAYERS and self.layer_store.weights_stay_put else None

    def _build_layer(self, index: int, loaded: dict):
        """Layer `index`'s weights from what the loader gave, where the layer store keeps them."""
        return self.layer_store.build(index, loaded, self.linear_method, self.dtype)

    def _native_decoder(self) -> NativeDecoder | None:
        try:
            return NativeDecoder.build(self)
        except NotNative as reason:
            logger.info("decoder layers run op by op: %s", reason)
            return None

    # Where embeddings, norms and the LM head live; decoder layers' linear weights say their own
    # tier (LinearWeight.tier: streamed ones live in host memory or on disk).
    RESIDENT_TIER = Tier.GPU

    def gpu_weight_bytes(self) -> int:
        """Bytes of the weights (and weight buffers) on the GPU: what its KV pool cannot use."""
        return sum(nbytes for (_, tier), nbytes in self.weight_bytes().items() if tier == self.RESIDENT_TIER)

    def weight_bytes(self) -> dict[tuple[str, str], int]:
        """Bytes of every weight by (format, tier): the linear weights as their objects report
        them, embeddings and norms in the compute dtype (a tied LM head is counted once), and the
        layer store's buffers."""
        totals: dict[tuple[str, str], int] = dict(self.layer_store.extra_weight_bytes())

        def count(fmt: str, tier: str, nbytes: int) -> None:
            totals[fmt, tier] = totals.get((fmt, tier), 0) + nbytes

        dense = str(self.dtype).removeprefix("torch.")
        tensors = [self.embed_tokens, self.final_norm, *(t for w in self.layers for t in w.dense_tensors())]
        count(dense, self.RESIDENT_TIER, sum(t.numel() * t.element_size() for t in tensors))
        linears = [w for layer in self.layers for w in layer.linear_weights()]
        if not self.config.tie_word_embeddings:
            linears.append(self.lm_head)
        for weight in linears:
            for part, tier in weight.placed_parts():
                count(part.format, tier, part.nbytes)
        return totals

    # ---- stages ---------------------------------------------------------------------------
    def pre_layer(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [num_tokens] -> hidden [num_tokens, hidden] (a later pipeline stage's: the
        previous stage's output, engine/distributed/stages.py)"""
        return self.layer_store.stage_input(token_ids, self._embed)

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.embed_tokens)

    def pre_proj(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor):
        """RMSNorm, fused QKV projection and RoPE.
        -> q [num_tokens, num_heads, head_dim], k and v [num_tokens, kv_heads, head_dim]"""
        if self.native is not None and self.native.applies(hidden):
            return self.native.pre_proj(layer, hidden, positions)
        cfg, w = self.config, self.layers[layer]
        qkv = w.qkv.apply(self.rms_norm(hidden, w.input_norm, cfg.rms_norm_eps))
        qk, v = qkv.split([cfg.q_size + cfg.kv_size, cfg.kv_size], dim=-1)
        # Q and K heads rotated in one pass: [num_tokens, num_heads + kv_heads, head_dim]
        qk = self.rope(self._normalize_heads(layer, qk.reshape(-1, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)),
                       positions)
        q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        return q, k, v.reshape(-1, cfg.num_kv_heads, cfg.head_dim)

    def _normalize_heads(self, layer: int, qk: torch.Tensor) -> torch.Tensor:
        """Q and K heads [num_tokens, num_heads + kv_heads, head_dim] before RoPE: as they are in
        the Llama family (Qwen3 normalizes each, engine/model/moe.py)."""
        return qk

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  kv_cache: TwoTierKVCache, meta: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        """The GPU's attention over the first `meta` rows (prefills, then decodes of
        GPU-requests): store the new K/V (prefill here, decode fused into the backend), attend.
        Rows past them (CPU-requests' decodes, pipelined forward) are left to the CPU.
        -> out [num_tokens, num_heads, head_dim]"""
        num_prefill = meta.num_prefill_tokens
        num_rows = num_prefill + meta.num_decodes
        out = torch.empty_like(q) if out is None else out
        if num_prefill:
            self._store_prefill(layer, k[:num_prefill], v[:num_prefill], kv_cache, meta)
            layout = kv_cache.gpu.layout
            stored_k, stored_v = layout.as_stored(k[:num_prefill], True), layout.as_stored(v[:num_prefill], False)
            out[:num_prefill] = self._prefill_attention(layer, q[:num_prefill], stored_k, stored_v, kv_cache, meta)
        if meta.num_decodes:
            gpu = kv_cache.gpu
            out[num_prefill:num_rows] = self.decode_backend.forward(
                q[num_prefill:num_rows], gpu.key[layer], gpu.value[layer],
                meta.decode_block_tables, meta.decode_context_lens, self.scale,
                k[num_prefill:num_rows], v[num_prefill:num_rows])
        return out

    def _prefill_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           kv_cache: TwoTierKVCache, meta: AttentionMetadata) -> torch.Tensor:
        """The prefills' attention: chunks after a cached prefix read it from the GPU pool in the
        Triton kernel where there is one, else gathered (from either pool) for SDPA."""
        prefixes = meta.prefill_prefixes
        if self.rowwise_prefill_kernel is not None:
            gpu = kv_cache.gpu
            return rowwise_prefill(self.rowwise_prefill_kernel, q, gpu.key[layer], gpu.value[layer],
                                   meta.prefill_seq_lens, {p.index: (p.num_cached_tokens, p.block_ids) for p in prefixes},
                                   meta.slot_blocks, gpu.block_size, self.scale,
                                   quantized_format_args(gpu.layout).get("kv_format"))
        if prefixes and self.paged_prefill_kernels is not None and not any(p.on_cpu for p in prefixes):
            gpu = kv_cache.gpu
            return paged_prefill(self.paged_prefill_kernels, q, k, v, gpu.key[layer], gpu.value[layer],
                                 meta.prefill_seq_lens, [(p.index, p.num_cached_tokens, p.block_ids) for p in prefixes],
                                 self.scale, **quantized_format_args(gpu.layout))
        prefixes_kv = self._cached_prefixes(layer, kv_cache, meta)
        return prefill_attention(q, k, v, meta.prefill_seq_lens, self.scale, prefixes_kv)

    def _cached_prefixes(self, layer: int, kv_cache: TwoTierKVCache,
                         meta: AttentionMetadata) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """The K/V each chunk after a cached prefix attends to, gathered from its pool onto the GPU."""
        prefixes = {}
        for prefix in meta.prefill_prefixes:
            key, value = kv_cache.pool(prefix.on_cpu).gather(layer, prefix.block_ids, prefix.num_cached_tokens)
            prefixes[prefix.index] = (key.to(self.device, non_blocking=True), value.to(self.device, non_blocking=True))
        return prefixes

    @staticmethod
    def _store_prefill(layer: int, k: torch.Tensor, v: torch.Tensor, kv_cache: TwoTierKVCache,
                       meta: AttentionMetadata) -> None:
        if meta.slot_rows is None:
            kv_cache.gpu.write(layer, k, v, meta.slot_blocks, meta.slot_offsets)
        elif meta.slot_rows.numel():
            kv_cache.gpu.write(layer, k[meta.slot_rows], v[meta.slot_rows], meta.slot_blocks, meta.slot_offsets)
        for row, count, position, host_blocks in meta.cpu_prefills:  # this layer's copy-out
            kv_cache.pool(on_cpu=True).write_blocks(layer, k[row:row + count], v[row:row + count],
                                                    host_blocks, position)

    def post_proj(self, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """O-proj, residual, RMSNorm, SwiGLU MLP, residual. attn_out [num_tokens, num_heads * head_dim]
        -> hidden [num_tokens, hidden]"""
        if self.native is not None and self.native.applies(hidden):
            return self.native.post_proj(layer, hidden, attn_out)
        w = self.layers[layer]
        hidden = hidden + w.o_proj.apply(attn_out)
        return hidden + self._mlp(layer, self.rms_norm(hidden, w.post_norm, self.config.rms_norm_eps))

    def _mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """The layer's SwiGLU MLP on normalized rows x [num_tokens, hidden] -> [num_tokens, hidden]."""
        return self.layers[layer].mlp.apply(x, self.silu_mul)

    def _native_decode_applies(self, hidden: torch.Tensor, meta: AttentionMetadata, kv_cache: TwoTierKVCache) -> bool:
        """A pure decode batch the C++ decoder takes whole: its stages apply, and the attention
        backend is the C++ kernel, which it calls itself."""
        return (self.native is not None and self.native.applies(hidden) and meta.num_prefill_tokens == 0
                and meta.num_decodes == hidden.shape[0] and isinstance(self.decode_backend, CpuPagedDecode)
                and kv_cache.gpu.key.is_cpu and kv_cache.gpu.layout.reads_as(hidden.dtype))

    def post_layer(self, hidden: torch.Tensor, output_rows: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head on the rows whose logits are wanted: each sequence's last token,
        then any prompt rows. -> logits [len(output_rows), vocab] fp32 (an earlier pipeline
        stage's: none, its hidden goes on to the next stage)"""
        return self.layer_store.stage_output(hidden, output_rows, self._logits)

    def _logits(self, hidden: torch.Tensor, output_rows: torch.Tensor) -> torch.Tensor:
        rows = self.rms_norm(hidden[output_rows], self.final_norm, self.config.rms_norm_eps)
        return self.lm_head.apply(rows).float()

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, kv_cache: TwoTierKVCache,
                meta: AttentionMetadata, output_rows: torch.Tensor) -> torch.Tensor:
        """One batch, layer after layer, all attention on the GPU (the GPU-only plan)."""
        hidden = self.pre_layer(token_ids)
        if self._native_decode_applies(hidden, meta, kv_cache):
            gpu = kv_cache.gpu
            hidden = self.native.decode(hidden, positions, gpu.key, gpu.value, meta.decode_block_tables,
                                        meta.decode_context_lens, self.scale, **quantized_format_args(gpu.layout))
            return self.post_layer(hidden, output_rows)
        for layer in range(self.config.num_layers):
            self.layer_store.acquire(layer)
            q, k, v = self.pre_proj(layer, hidden, positions)
            attn_out = self.attention(layer, q, k, v, kv_cache, meta)
            hidden = self.post_proj(layer, hidden, attn_out.view(q.shape[0], -1))
            self.layer_store.release(layer)
        return self.post_layer(hidden, output_rows)

