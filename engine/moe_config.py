"""The mixture-of-experts part of a model's configuration (torch-free, like engine/model_config.py).

One frozen `MoeConfig` for every family: how many experts, how many each token uses, their
width, whether the chosen experts' router probabilities are renormalized to sum to one, which
layers keep a dense MLP instead, and an optional shared expert every token passes through.
The readers below turn a Hugging Face config or GGUF metadata of one family into it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping


class MoeConfigError(ValueError):
    """A mixture-of-experts configuration that cannot be served; the message names the field."""


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    num_experts_per_token: int  # top-k
    expert_intermediate_size: int  # width of each expert's SwiGLU MLP
    normalize_top_k: bool  # the k chosen probabilities divided by their sum (Mixtral: always)
    # layers whose MLP is the dense SwiGLU of width ModelConfig.intermediate_size (Qwen-MoE's
    # `mlp_only_layers` and `decoder_sparse_step`)
    dense_layers: tuple[int, ...] = ()
    # a SwiGLU MLP every token passes through beside the routed experts (0: none), and whether
    # its output is scaled by sigmoid(a [1, hidden] gate) first (Qwen2-MoE's shared_expert_gate)
    shared_expert_intermediate_size: int = 0
    shared_expert_gated: bool = False

    def __post_init__(self) -> None:
        for field in ("num_experts", "num_experts_per_token", "expert_intermediate_size"):
            if getattr(self, field) <= 0:
                raise MoeConfigError(f"{field} must be positive, got {getattr(self, field)}")
        if self.num_experts_per_token > self.num_experts:
            raise MoeConfigError(f"num_experts_per_token ({self.num_experts_per_token}) exceeds "
                                 f"num_experts ({self.num_experts})")
        if self.shared_expert_intermediate_size < 0:
            raise MoeConfigError("shared_expert_intermediate_size must not be negative, "
                                 f"got {self.shared_expert_intermediate_size}")

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_expert_intermediate_size > 0


def _mixtral_from_hf(d: Mapping[str, Any], num_layers: int) -> MoeConfig:
    return MoeConfig(num_experts=int(d.get("num_local_experts", 8)),
                     num_experts_per_token=int(d.get("num_experts_per_tok", 2)),
                     expert_intermediate_size=int(d["intermediate_size"]), normalize_top_k=True)


def _qwen_moe_fields(d: Mapping[str, Any], num_layers: int, shared_expert_intermediate_size: int) -> MoeConfig:
    """Qwen2-MoE and Qwen3-MoE: a layer is dense when listed in `mlp_only_layers`, or when
    (layer + 1) is not a multiple of `decoder_sparse_step`."""
    step = int(d.get("decoder_sparse_step", 1))
    if step <= 0:
        raise MoeConfigError(f"decoder_sparse_step must be positive, got {step}")
    mlp_only = set(int(i) for i in d.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(num_layers) if i in mlp_only or (i + 1) % step)
    # published Qwen checkpoints say `num_experts`; transformers 5 writes `num_local_experts`
    num_experts = d["num_experts"] if "num_experts" in d else d["num_local_experts"]
    return MoeConfig(num_experts=int(num_experts), num_experts_per_token=int(d["num_experts_per_tok"]),
                     expert_intermediate_size=int(d["moe_intermediate_size"]),
                     normalize_top_k=bool(d.get("norm_topk_prob", False)), dense_layers=dense,
                     shared_expert_intermediate_size=shared_expert_intermediate_size,
                     shared_expert_gated=shared_expert_intermediate_size > 0)


def _qwen2_moe_from_hf(d: Mapping[str, Any], num_layers: int) -> MoeConfig:
    """Qwen2-MoE: a shared expert behind a sigmoid gate in every MoE layer."""
    return _qwen_moe_fields(d, num_layers, int(d["shared_expert_intermediate_size"]))


def _qwen3_moe_from_hf(d: Mapping[str, Any], num_layers: int) -> MoeConfig:
    """Qwen3-MoE: routed experts only."""
    return _qwen_moe_fields(d, num_layers, 0)


# family name (ModelConfig.architecture) -> reader of the HF config's MoE fields
MOE_FROM_HF: dict[str, Callable[[Mapping[str, Any], int], MoeConfig]] = {
    "mixtral": _mixtral_from_hf,
    "qwen2_moe": _qwen2_moe_from_hf,
    "qwen3_moe": _qwen3_moe_from_hf,
}

# Whether llama.cpp renormalizes the chosen experts' weights, per GGUF architecture, where the file
# does not say (`<arch>.expert_weights_norm`): Mixtral (`llama`) and Qwen3-MoE do, Qwen2-MoE does not.
_GGUF_NORMALIZES_TOP_K = {"llama": True, "qwen3moe": True, "qwen2moe": False}


def moe_from_gguf(arch_name: str, get: Callable[..., Any], feed_forward_length: int) -> MoeConfig | None:
    """The MoE fields of GGUF metadata (`get(key, default)` reads `<arch>.<key>`), or None for
    a dense model (no `expert_count`)."""
    num_experts = int(get("expert_count", 0) or 0)
    if num_experts == 0:
        return None
    if arch_name not in _GGUF_NORMALIZES_TOP_K:
        raise MoeConfigError(f"GGUF architecture {arch_name!r} with experts is not supported; "
                             f"supported: {sorted(_GGUF_NORMALIZES_TOP_K)}")
    shared = int(get("expert_shared_feed_forward_length", 0) or 0)
    return MoeConfig(num_experts=num_experts, num_experts_per_token=int(get("expert_used_count")),
                     expert_intermediate_size=int(get("expert_feed_forward_length", feed_forward_length)),
                     normalize_top_k=bool(get("expert_weights_norm", _GGUF_NORMALIZES_TOP_K[arch_name])),
                     shared_expert_intermediate_size=shared, shared_expert_gated=shared > 0)
