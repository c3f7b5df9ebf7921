"""The memory model of weight placement: bytes of every weight, buffer, pool and activation
(PIPO sec. 3.5 and App. B, adapted to tandem's engine). Plain Python, no torch.

A decoder layer's linear weights are stored as one *layer image*: their tensors one after the
other, each starting on IMAGE_TENSOR_ALIGN_BYTES, the whole padded to IMAGE_ALIGN_BYTES. The
engine lays its images out with `image_layout` (engine/weights/layer_image.py), so what the
planner counts is what the engine allocates, and an image is one read from disk and one copy to
the GPU (PIPO's data merging).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from scheduler.modes import Mode
from scheduler.planning.cost_model import ModelShape, kv_bytes_per_token

GIB_BYTES = 2**30
# Each tensor of an image starts here: the kernels' vector loads and cudaMalloc's own alignment.
IMAGE_TENSOR_ALIGN_BYTES = 256
# A whole image is padded to this: O_DIRECT reads need file offsets, lengths and buffers on the
# device's logical block (512 B or 4 KiB; 4 KiB covers both).
IMAGE_ALIGN_BYTES = 4096
# INT4 weights as kernels/cpu/int4.py keeps them: 4-bit codes, fp32 scale and min per group of
# 32 along the input, output rows padded to tiles of 16 (the CPU kernels' layout; CUDA's canonical
# layout has no padding, so this over-counts there by at most 15 rows a weight).
INT4_GROUP_SIZE = 32
INT4_TILE_ROWS = 16
INT4_PARAM_BYTES = 4
# Rows up to which the INT4 kernels multiply packed weights; above, a dense scratch copy of the
# largest weight is counted (engine/quant/int4.py: the default prefill path dequantizes).
INT4_KERNEL_MAX_ROWS = 64
LOGITS_BYTES = 4  # the LM head's output is fp32


class Quantization(Mode):
    """--quantization: the decoder layers' weight format."""

    # the fit (engine/planning/fit.py) chooses: 4-bit blocks a GGUF stores stay packed, and 16-bit
    # weights are quantized only where memory binds and the performance model predicts a gain
    AUTO = "auto"
    NONE = "none"  # dense in the compute dtype
    INT4 = "int4"


QUANTIZATIONS = (Quantization.NONE, Quantization.INT4)  # the formats a weight is stored in


def align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def image_layout(tensor_bytes: Iterable[int]) -> tuple[list[int], int]:
    """Offsets of tensors of these sizes laid out one after the other in an image, and the image's
    padded size."""
    offsets, end = [], 0
    for nbytes in tensor_bytes:
        start = align_up(end, IMAGE_TENSOR_ALIGN_BYTES)
        offsets.append(start)
        end = start + nbytes
    return offsets, align_up(max(end, 1), IMAGE_ALIGN_BYTES)


@dataclass(frozen=True)
class WeightFormat:
    """How decoder layers' linear weights are stored: dense in the compute dtype, or INT4."""

    quantization: Quantization  # none | int4
    dtype_bytes: int  # the compute dtype: dense weights, biases, norms, embeddings, activations, KV

    def __post_init__(self) -> None:
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        object.__setattr__(self, "quantization", Quantization(self.quantization))  # the word given, as its member
        if self.dtype_bytes not in (2, 4):
            raise ValueError(f"dtype_bytes must be 2 or 4, got {self.dtype_bytes}")

    def linear_tensor_bytes(self, out_features: int, in_features: int) -> list[int]:
        """Bytes of each tensor one [out, in] weight is stored as, in image order."""
        if self.quantization == Quantization.NONE:
            return [out_features * in_features * self.dtype_bytes]
        rows = align_up(out_features, INT4_TILE_ROWS)
        params = rows * (in_features // INT4_GROUP_SIZE) * INT4_PARAM_BYTES
        return [rows * in_features // 2, params, params]  # codes, scales, mins


# A MoE layer's weights the engine keeps dense whatever the format (engine/model/moe.py): tiny,
# and a rounding there changes which experts a token gets.
ALWAYS_DENSE_LINEARS = frozenset({"router", "shared_expert_gate"})


def linear_shapes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """[out, in] of each linear weight of a layer, in image order (fused QKV and gate/up; a MoE
    layer's router, then each expert's gate/up and down, then the shared expert's)."""
    hidden = shape.hidden_size
    shapes = {"qkv": (shape.q_size + 2 * shape.kv_size, hidden), "o_proj": (hidden, shape.q_size)}
    if not shape.is_moe:
        return {**shapes, **_mlp_shapes("", hidden, shape.intermediate_size)}
    shapes["router"] = (shape.num_experts, hidden)
    for expert in range(shape.num_experts):
        shapes.update(_mlp_shapes(f"experts.{expert}.", hidden, shape.expert_intermediate_size))
    if shape.shared_expert_intermediate_size:
        shapes.update(_mlp_shapes("shared_expert.", hidden, shape.shared_expert_intermediate_size))
        shapes["shared_expert_gate"] = (1, hidden)
    return shapes


def _mlp_shapes(prefix: str, hidden: int, intermediate: int) -> dict[str, tuple[int, int]]:
    return {f"{prefix}gate_up": (2 * intermediate, hidden), f"{prefix}down": (hidden, intermediate)}


def layer_image_bytes(shape: ModelShape, fmt: WeightFormat, skip: Callable[[str], bool] = lambda name: False) -> int:
    """One decoder layer's linear weights (and QKV bias) as an image, less those `skip` names."""
    dense = WeightFormat("none", fmt.dtype_bytes)
    sizes: list[int] = []
    for name, (out_features, in_features) in linear_shapes(shape).items():
        if skip(name):
            continue
        sizes += (dense if name in ALWAYS_DENSE_LINEARS else fmt).linear_tensor_bytes(out_features, in_features)
        if name == "qkv" and shape.attention_bias:
            sizes.append(out_features * fmt.dtype_bytes)
    return image_layout(sizes)[1]


def resident_global_bytes(shape: ModelShape, dtype_bytes: int) -> int:
    """What always stays on the GPU: embeddings, the LM head (unless tied), the final norm
    and every layer's two norms, all dense in the compute dtype."""
    matrices = 1 if shape.tie_word_embeddings else 2
    vectors = 1 + 2 * shape.num_layers
    return (matrices * shape.vocab_size + vectors) * shape.hidden_size * dtype_bytes


def kv_block_bytes(shape: ModelShape, block_size: int, dtype_bytes: int) -> int:
    """One KV block across all layers, K and V (engine/kv's pools)."""
    return block_size * kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, dtype_bytes)


def activation_peak_bytes(shape: ModelShape, fmt: WeightFormat, num_tokens: int, num_logit_rows: int) -> int:
    """The largest set of activations live at once in a forward of `num_tokens` packed tokens with
    `num_logit_rows` rows through the LM head (App. B's M_mha / M_mlp / M_embed, for tandem's
    stages: attention is computed per sequence without the [s, s] score matrix, the MLP's gate
    and up are one fused output, logits are fp32)."""
    p, d, inter = fmt.dtype_bytes, shape.hidden_size, shape.intermediate_size
    attention = num_tokens * (2 * d + 2 * shape.q_size + 2 * shape.kv_size) * p  # hidden, normed, qkv, out
    mlp = num_tokens * (2 * d + 3 * inter) * p  # hidden, normed, gate/up, silu(gate) * up
    if shape.is_moe:  # one expert at a time over at most every token, beside the output being summed
        inter = max(shape.expert_intermediate_size, shape.shared_expert_intermediate_size)
        routing = num_tokens * shape.num_experts * LOGITS_BYTES  # fp32 router probabilities
        mlp = num_tokens * (4 * d + 3 * inter) * p + routing  # + the rows gathered and the sum
    head = num_logit_rows * (d * p + shape.vocab_size * (p + LOGITS_BYTES))
    scratch = 0
    if fmt.quantization == Quantization.INT4 and num_tokens > INT4_KERNEL_MAX_ROWS:
        scratch = max(n * k for n, k in linear_shapes(shape).values()) * p  # the dequantized weight
    return max(attention, mlp, head) + scratch


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes of one placement, by where they live."""

    global_bytes: int  # GPU: embeddings, LM head, norms
    resident_layer_bytes: int  # GPU: layers kept there
    buffer_bytes: int  # GPU: the ring of layer buffers streamed layers pass through
    kv_cache_bytes: int  # GPU KV pool
    activation_bytes: int  # GPU: peak activations
    host_layer_bytes: int  # host memory: layers streamed from there (pinned on CUDA)
    staging_bytes: int  # host memory: aligned buffers disk reads land in
    host_kv_cache_bytes: int  # host KV pool (Neo)
    disk_layer_bytes: int  # the offload directory: layers streamed from disk

    @property
    def gpu_weight_bytes(self) -> int:
        """What --weights-gpu-gib bounds: weights and the buffers weights pass through."""
        return self.global_bytes + self.resident_layer_bytes + self.buffer_bytes

    @property
    def gpu_bytes(self) -> int:
        return self.gpu_weight_bytes + self.kv_cache_bytes + self.activation_bytes

    @property
    def host_bytes(self) -> int:
        return self.host_layer_bytes + self.staging_bytes + self.host_kv_cache_bytes

    def to_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in (
            "global_bytes", "resident_layer_bytes", "buffer_bytes", "kv_cache_bytes", "activation_bytes",
            "host_layer_bytes", "staging_bytes", "host_kv_cache_bytes", "disk_layer_bytes",
            "gpu_weight_bytes", "gpu_bytes", "host_bytes")}
