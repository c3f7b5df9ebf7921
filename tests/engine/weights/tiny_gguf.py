"""Tiny random GGUF models written the way llama.cpp's converter writes them, and the weights a
loader must give back from them: the factory the GGUF tests share."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from engine.model_config import ModelConfig
from engine.weights import global_shapes, layer_shapes
from engine.weights.gguf_loader import SUPPORTED_TYPES

# Rows of 256 (hidden and intermediate) so that the K-quants' 256-weight super-blocks fit.
GGUF_SHAPE = dict(vocab_size=128, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2)
GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm.weight",
    "q_proj": "attn_q.weight",
    "k_proj": "attn_k.weight",
    "v_proj": "attn_v.weight",
    "o_proj": "attn_output.weight",
    "post_attention_layernorm": "ffn_norm.weight",
    "gate_proj": "ffn_gate.weight",
    "up_proj": "ffn_up.weight",
    "down_proj": "ffn_down.weight",
    "q_bias": "attn_q.bias",
    "k_bias": "attn_k.bias",
    "v_bias": "attn_v.bias",
}
GGUF_GLOBAL_NAMES = {"embed_tokens": "token_embd.weight", "norm": "output_norm.weight", "lm_head": "output.weight"}
# The types gguf-py dequantizes but cannot quantize: written as random blocks. Their fp16 fields
# (d, and dmin where the type has one) sit at these byte offsets of a block (gguf/quants.py's
# unpacking), and get finite random values rather than random bytes, which may be inf or NaN.
RANDOM_BLOCK_FP16_OFFSETS = {
    QType.Q2_K: (80, 82),
    QType.Q3_K: (108,),
    QType.Q4_K: (0, 2),
    QType.Q5_K: (0, 2),
    QType.Q6_K: (208,),
}
_FP16_EXPONENTS = (-16, -10)  # |d| log-uniform over these powers of two, fp16 subnormals included


def random_blocks(rng: np.random.Generator, qtype: QType, rows: int, cols: int) -> np.ndarray:
    """Valid random blocks of `qtype` for a [rows, cols] tensor: uint8 [rows, bytes per row]."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // block_size, type_size), dtype=np.uint8)
    for offset in RANDOM_BLOCK_FP16_OFFSETS[qtype]:
        magnitude = np.exp2(rng.uniform(*_FP16_EXPONENTS, blocks.shape[:2]))
        sign = rng.choice(np.array([-1.0, 1.0]), blocks.shape[:2])
        blocks[..., offset:offset + 2] = (sign * magnitude).astype(np.float16)[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows: each head's rotary halves interleaved."""
    head_dim = weight.shape[0] // num_heads
    return weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def new_gguf_writer(path: Path, architecture: str, config: ModelConfig) -> gguf.GGUFWriter:
    """A writer of `architecture` with the metadata llama.cpp reads a model's shape from."""
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    return writer


def write_tiny_gguf(path: Path, architecture: str = "llama", qtype: QType = QType.F32, tie: bool = False,
                    skip: tuple[str, ...] = (), types: dict[str, QType] | None = None,
                    seed: int = 0) -> tuple[dict, str]:
    """Write a tiny random GGUF model of GGUF_SHAPE the way llama.cpp's converter would: matrices
    of type `qtype` unless `types` names another for a tensor, norms F32, Q/K rows permuted for
    llama. Types gguf-py quantizes hold quantized normal values, the K-quants random blocks, and
    types the loader refuses zeros.

    Returns (the HF-layout weights a loader must give back, as {"globals"|index: {key: tensor}},
    the name of the tensor written last).
    """
    rng = np.random.default_rng(seed)
    config = ModelConfig(
        architecture=architecture, head_dim=GGUF_SHAPE["hidden_size"] // GGUF_SHAPE["num_heads"], rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=tie,
        attention_bias=architecture == "qwen2", **GGUF_SHAPE,
    )
    writer = new_gguf_writer(path, architecture, config)

    last_name = ""

    def add(name: str, shape: tuple[int, ...], heads: int | None) -> torch.Tensor | None:
        nonlocal last_name
        if name in skip:
            return None
        qtype_here = (types or {}).get(name, qtype if len(shape) == 2 else QType.F32)  # norms stay F32

        def in_file(array: np.ndarray) -> np.ndarray:
            # Quant blocks run along rows, so permuting rows commutes with (de)quantizing.
            return llama_cpp_permute(array, heads) if architecture == "llama" and heads else array

        if qtype_here in RANDOM_BLOCK_FP16_OFFSETS:
            blocks = random_blocks(rng, qtype_here, shape[0], shape[-1])
            data = in_file(blocks)
            values = gguf.quants.dequantize(blocks, qtype_here).reshape(shape)
        elif qtype_here in SUPPORTED_TYPES:
            normal = rng.standard_normal(shape, dtype=np.float32)
            data = gguf.quants.quantize(in_file(normal), qtype_here)
            values = gguf.quants.dequantize(gguf.quants.quantize(normal, qtype_here), qtype_here)
        else:  # a type the loader refuses: any bytes of the right size
            block_size, type_size = gguf.GGML_QUANT_SIZES[qtype_here]
            data = np.zeros((shape[0], shape[-1] // block_size * type_size), dtype=np.uint8)
            values = None
        writer.add_tensor(name, data, raw_dtype=qtype_here)
        last_name = name
        return None if values is None else torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))

    heads_of = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads,
                "q_bias": config.num_heads, "k_bias": config.num_kv_heads}
    expected: dict = {}
    expected["globals"] = {
        key: add(GGUF_GLOBAL_NAMES[key], shape, None) for key, shape in global_shapes(config).items()
    }
    for index in range(config.num_layers):
        expected[index] = {
            key: add(f"blk.{index}.{GGUF_LAYER_NAMES[key]}", shape, heads_of.get(key))
            for key, shape in layer_shapes(config).items()
        }
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected, last_name
