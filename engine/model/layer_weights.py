"""A dense decoder layer's weights as the model computes with them: its norms and four linear weight
objects (the MLP a feed-forward part, which a plan may slice), built from what a loader gives."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.feed_forward import FeedForward, Make, SwiGluMlp
from engine.quant import LinearMethod, LinearWeight
from engine.quant.int4 import fuse


def linear_maker(linear: LinearMethod, dtype: torch.dtype, device: torch.device,
                 layout_device: torch.device | None = None) -> Make:
    """`make(weight, bias=None)`: a loaded matrix as `linear`'s weight object computing in `dtype` on `device`."""
    def make(weight, bias: torch.Tensor | None = None) -> LinearWeight:
        return linear.create_weight(weight, bias, dtype=dtype, device=device, layout_device=layout_device)

    return make


def attention_linears(w: dict, make: Make) -> dict[str, LinearWeight]:
    """A loaded layer's attention projections as weight objects: the fused QKV (with Qwen2's
    bias) and the O-projection, as LayerWeights' fields of those names."""
    bias = None
    if "q_bias" in w:
        bias = torch.cat([w["q_bias"], w["k_bias"], w["v_bias"]])
    return {"qkv": make(fuse([w["q_proj"], w["k_proj"], w["v_proj"]]), bias), "o_proj": make(w["o_proj"])}


def attention_weights(w: dict, make: Make, device: torch.device) -> dict:
    """The attention half of a decoder layer from a loader's layer: its norms on `device` and its
    projections (attention_linears)."""
    return dict(input_norm=w["input_layernorm"].to(device), post_norm=w["post_attention_layernorm"].to(device),
                **attention_linears(w, make))


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: LinearWeight  # [q_size + 2 * kv_size, hidden], Q, K and V fused into one matmul (bias: Qwen2)
    o_proj: LinearWeight  # [hidden, q_size]
    post_norm: torch.Tensor  # [hidden]
    mlp: FeedForward  # a SwiGluMlp, or one sliced across the CPU and the GPU

    @classmethod
    def from_loaded(cls, w: dict, linear: LinearMethod, dtype: torch.dtype, device: torch.device,
                    layout_device: torch.device | None = None) -> "LayerWeights":
        """From a loader's layer (tensors, and packed 4-bit weights where the method takes them);
        `layout_device`: whose kernels the weights are laid out for, when they are stored elsewhere
        (a streamed layer, kept on the host until it is copied to the GPU)."""
        make = linear_maker(linear, dtype, device, layout_device)
        return cls(**attention_weights(w, make, device), mlp=SwiGluMlp.from_loaded(w, make))

    @classmethod
    def of_linears(cls, input_norm: torch.Tensor, post_norm: torch.Tensor,
                   linears: dict[str, LinearWeight]) -> "LayerWeights":
        """From the norms and the four linear weights by name (`named_linears`' names)."""
        return cls(input_norm, linears["qkv"], linears["o_proj"], post_norm,
                   SwiGluMlp(linears["gate_up"], linears["down"]))

    def named_linears(self) -> dict[str, LinearWeight]:
        """A dense layer's linear weights by name, in a layer image's order (layer_image.LINEAR_NAMES)."""
        if not isinstance(self.mlp, SwiGluMlp):
            raise TypeError(f"a layer whose MLP is a {type(self.mlp).__name__} has no single gate_up and down")
        return dict(qkv=self.qkv, o_proj=self.o_proj, gate_up=self.mlp.gate_up, down=self.mlp.down)

    def linear_weights(self) -> tuple[LinearWeight, ...]:
        """Every linear weight of the layer, for reports."""
        return (self.qkv, self.o_proj, *self.mlp.linear_weights())

    def dense_tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors outside weight objects (norms), for reports."""
        return (self.input_norm, self.post_norm)
