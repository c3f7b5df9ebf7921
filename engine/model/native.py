"""The decoder layers of a decode-sized batch in one C++ call (kernels/cpu/decoder.h).

Op by op, a decode step makes about 20 Python calls per layer, which at batch 1 cost more than
the attention and the small ops themselves. `NativeDecoder` hands the C++ decoder pointers to
every layer's weights once, at load, and then runs a layer's `pre_proj` or `post_proj` in one
call each, or every layer of a pure decode batch in one call. It strings together the very
kernels the fused op-by-op path calls, with the same roundings, so the two agree
(tests/engine/model/test_native.py).

It applies where every piece has its kernel: a dense Llama-family layer (no mixture of experts,
no per-head Q/K norms); CPU tensors; each matmul an INT4 weight on the CPU
kernels' tiled layout or a dense fp32/bf16/fp16 one; widths multiples of 16 (head_dim of 32); and
at most `max_tokens` rows (MAX_INT16_ROWS: the batches whose x the op-by-op path quantizes to int16
as the decoder does, larger chunks running op by op; or the dense GEMV's 4 where the model holds a
dense matmul).
`NativeDecoder.build` says why not otherwise, and the model keeps its op-by-op stages.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.feed_forward import SwiGluMlp
from engine.quant import LinearWeight
from engine.quant.base import WrappedWeight
from engine.quant.dense import DenseWeight
from engine.quant.int4 import MAX_INT16_ROWS, Int4Weight
from kernels import cpu as cpu_kernels
from kernels import kv_quant
from kernels.cpu import int4 as int4_kernels

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # tandem::DType
_WIDTH_MULTIPLE = 16  # the elementwise kernels' vector width
_HEAD_DIM_MULTIPLE = 32  # RoPE's: each half a multiple of the width
# Sequences each attention thread gets at least. Each sequence stays on one thread (a one-thread
# call's bits whatever the count), and a second thread gains nothing below two sequences each
# (docs/benchmarks.md, "Measurements behind code choices").
MIN_SEQUENCES_PER_ATTENTION_THREAD = 2


class NotNative(ValueError):
    """A model (or one of its weights) the C++ decoder does not cover, and why."""


@dataclass
class NativeDecoder:
    decoder: object  # kernels.cpu._cpu_kernels.Decoder
    max_tokens: int  # rows every weight's kernel takes
    keep_alive: list  # tensors the decoder holds pointers into (all the model's own)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def build(cls, model, isa: str | None = None) -> "NativeDecoder":
        """From a loaded LlamaModel (kernels of instruction set `isa`, default the best this CPU
        has); NotNative with the reason where it does not apply."""
        cfg = model.config
        if cfg.is_moe:
            raise NotNative(f"{cfg.architecture}: the C++ decoder's layer is Llama's dense MLP, not routed experts")
        if cfg.qk_norm:
            raise NotNative(f"{cfg.architecture}: the C++ decoder has no RMSNorm over each Q and K head")
        if not cpu_kernels.is_available() or model.device.type != "cpu":
            raise NotNative("the model is not on the CPU, or the CPU kernels are not built")
        if model.dtype not in _DTYPE_CODES:
            raise NotNative(f"compute dtype {model.dtype}")
        widths = (cfg.hidden_size, cfg.intermediate_size, cfg.kv_size)
        if any(width % _WIDTH_MULTIPLE for width in widths) or cfg.head_dim % _HEAD_DIM_MULTIPLE:
            raise NotNative(f"widths {widths} and head_dim {cfg.head_dim} must be multiples of "
                            f"{_WIDTH_MULTIPLE} and {_HEAD_DIM_MULTIPLE}")
        ext = cpu_kernels._extension()
        shape = ext.DecoderShape()
        shape.dtype, shape.hidden, shape.intermediate = _DTYPE_CODES[model.dtype], cfg.hidden_size, cfg.intermediate_size
        shape.num_heads, shape.num_kv_heads, shape.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        shape.eps, shape.cos, shape.sin = cfg.rms_norm_eps, model.rope.cos.data_ptr(), model.rope.sin.data_ptr()
        shape.linear_threads, shape.isa = int4_kernels.default_num_threads(), isa or cpu_kernels.current_isa()
        decoder = ext.Decoder(shape)
        keep_alive, row_limits = [model.rope.cos, model.rope.sin], [MAX_INT16_ROWS]
        for w in model.layers:
            layer = ext.DecoderLayer()
            layer.input_norm, layer.post_norm = _pointer(w.input_norm, model.dtype), _pointer(w.post_norm, model.dtype)
            keep_alive += [w.input_norm, w.post_norm]
            if not isinstance(w.mlp, SwiGluMlp):
                raise NotNative(f"layer's MLP is a {type(w.mlp).__name__}, not one SwiGLU MLP")
            linears = dict(qkv=w.qkv, o_proj=w.o_proj, gate_up=w.mlp.gate_up, down=w.mlp.down)
            for name, weight in linears.items():
                if isinstance(weight, WrappedWeight):  # its apply does more than its matrix: a copy, a collective
                    raise NotNative(f"the {name} weight is a {type(weight).__name__}")
                parts = [_linear_part(ext, part, model.dtype, keep_alive, row_limits) for part in weight.parts]
                setattr(layer, name, parts)
            decoder.add_layer(layer)
        return cls(decoder, min(row_limits), keep_alive, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, model.dtype)

    def applies(self, hidden: torch.Tensor) -> bool:
        return 0 < hidden.shape[0] <= self.max_tokens and hidden.dtype == self.dtype and hidden.is_cpu

    def pre_proj(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor):
        """As LlamaModel.pre_proj: -> q [tokens, heads, head_dim], k and v [tokens, kv_heads, head_dim]."""
        hidden, positions = hidden.contiguous(), positions.contiguous()
        tokens = hidden.shape[0]
        q = torch.empty(tokens, self.num_heads, self.head_dim, dtype=self.dtype)
        k = torch.empty(tokens, self.num_kv_heads, self.head_dim, dtype=self.dtype)
        v = torch.empty_like(k)
        self.decoder.pre_proj(layer, hidden.data_ptr(), positions.data_ptr(), tokens, q.data_ptr(), k.data_ptr(),
                              v.data_ptr())
        return q, k, v

    def post_proj(self, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """As LlamaModel.post_proj: hidden [tokens, hidden], attn_out [tokens, heads * head_dim]."""
        hidden, attn_out = hidden.contiguous(), attn_out.to(self.dtype).contiguous()
        out = torch.empty_like(hidden)
        self.decoder.post_proj(layer, hidden.data_ptr(), attn_out.data_ptr(), hidden.shape[0], out.data_ptr())
        return out

    def decode(self, hidden: torch.Tensor, positions: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, *, kv_format: str | None = None,
               block_size: int | None = None) -> torch.Tensor:
        """Every layer of a decode batch (one new token per sequence, its K/V appended to the
        paged caches key and value [layers, blocks, ...] as the decode backend's layout has them).
        kv_format "int8"/"int4"/"k8v4" reads group-quantized pools [layers, blocks, kv_heads, unit_bytes]
        uint8 (kernels/kv_quant.py) of the given block_size instead of caches in the model's dtype.
        hidden [tokens, hidden] -> the last layer's output."""
        hidden = hidden.contiguous().clone()
        positions, block_tables, context_lens = positions.contiguous(), block_tables.contiguous(), context_lens.contiguous()
        if not (key.is_contiguous() and value.is_contiguous()):
            raise ValueError("the KV caches must be contiguous")
        kv = cpu_kernels._extension().PagedKV()
        kv.key, kv.value = key.data_ptr(), value.data_ptr()
        if kv_format is None:
            if key.dtype != self.dtype or value.dtype != self.dtype:
                raise ValueError(f"the KV caches must be {self.dtype}, got {key.dtype}")
            kv.kv_dtype, kv.block_size = _DTYPE_CODES[key.dtype], value.shape[3]
        else:
            self._check_quantized_pools(key, value, kv_format, block_size)
            kv.kv_dtype, kv.block_size = kv_quant.FORMAT_CODES[kv_format], block_size
        kv.num_blocks = value.shape[1]
        kv.block_tables, kv.context_lens = block_tables.data_ptr(), context_lens.data_ptr()
        kv.max_blocks_per_seq, kv.scale = block_tables.shape[1], float(scale)
        kv.threads = max(1, min(cpu_kernels.default_num_threads(), hidden.shape[0] // MIN_SEQUENCES_PER_ATTENTION_THREAD))
        self.decoder.decode(hidden.data_ptr(), positions.data_ptr(), hidden.shape[0], kv)
        return hidden

    def _check_quantized_pools(self, key: torch.Tensor, value: torch.Tensor, kv_format: str,
                               block_size: int | None) -> None:
        """ValueError unless key and value are kv_format pools [layers, blocks, kv_heads, unit_bytes]."""
        if block_size is None or block_size % cpu_kernels.QUANTIZED_BLOCK_MULTIPLE:
            raise ValueError(f"a {kv_format} KV cache needs block_size, a multiple of "
                             f"{cpu_kernels.QUANTIZED_BLOCK_MULTIPLE}, got {block_size}")
        layout = kv_quant.layout_for(kv_format, self.head_dim, block_size)
        for name, pool, side in (("key", key, layout.key), ("value", value, layout.value)):
            expected = (key.shape[0], key.shape[1], self.num_kv_heads, side.unit_bytes)
            if pool.dtype != torch.uint8 or tuple(pool.shape) != expected:
                raise ValueError(f"the {kv_format} {name} pools must be uint8 {expected}, got {pool.dtype} "
                                 f"{tuple(pool.shape)}")


def _pointer(tensor: torch.Tensor, dtype: torch.dtype) -> int:
    if not (tensor.is_cpu and tensor.is_contiguous() and tensor.dtype == dtype):
        raise NotNative(f"a norm weight is not a contiguous CPU {dtype} tensor")
    return tensor.data_ptr()


def _linear_part(ext, weight: LinearWeight, dtype: torch.dtype, keep_alive: list, row_limits: list):
    """One single-format weight as the decoder's LinearPart (its tensors added to keep_alive,
    its kernel's row limit to row_limits); NotNative for a format without a CPU kernel."""
    part = ext.LinearPart()
    part.n, part.k = weight.out_features, weight.in_features
    if part.k % _WIDTH_MULTIPLE or part.n % _WIDTH_MULTIPLE:
        raise NotNative(f"a {part.n}x{part.k} weight: both must be multiples of {_WIDTH_MULTIPLE}")
    if isinstance(weight, Int4Weight) and isinstance(weight.weight, int4_kernels.TiledInt4):
        tiled = weight.weight
        part.is_int4, part.group_size = True, tiled.group_size
        part.codes, part.scales, part.mins = tiled.codes.data_ptr(), tiled.scales.data_ptr(), tiled.mins.data_ptr()
        keep_alive += [tiled.codes, tiled.scales, tiled.mins]
    elif isinstance(weight, DenseWeight) and weight.weight.is_cpu and weight.weight.is_contiguous() \
            and weight.weight.dtype in _DTYPE_CODES:
        part.weight, part.weight_dtype = weight.weight.data_ptr(), _DTYPE_CODES[weight.weight.dtype]
        keep_alive.append(weight.weight)
        row_limits.append(cpu_kernels.DENSE_LINEAR_MAX_ROWS)
    else:
        raise NotNative(f"a {type(weight).__name__} ({weight.format}) has no C++ decoder kernel")
    if weight.bias is not None:
        part.bias = _pointer(weight.bias, dtype)
        keep_alive.append(weight.bias)
    return part
