"""Model configuration: a frozen dataclass, validated once. The engine's own lives in engine/config.py.

`ModelConfig` is read from a Hugging Face `config.json`, from GGUF metadata, or from a
shape preset in `configs/models/` (presets are written as HF config dicts, so one reader
serves both, and the scheduler's `ModelShape` is built from it rather than parsed again).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from engine.moe_config import MOE_FROM_HF, MoeConfig, MoeConfigError, moe_from_gguf
from scheduler.planning.cost_model import ModelShape

PRESET_DIR = Path(__file__).resolve().parents[1] / "configs" / "models"

# HF architectures names -> our family names. All are the Llama block with small variations; the
# mixture-of-experts families swap the MLP for routed experts (engine/model/moe.py).
_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
# GGUF `general.architecture` values we can run. llama.cpp writes Mixtral as `llama` with experts.
_GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen2moe": "qwen2_moe",
                       "qwen3moe": "qwen3_moe"}
_GGUF_MOE_FAMILIES = {"llama": "mixtral"}  # a dense family's name once the file has experts
# Families with RMSNorm over each Q and K head before RoPE (`q_norm`, `k_norm`).
_QK_NORM_FAMILIES = frozenset({"qwen3_moe"})
# Families whose Q, K and V projections carry a bias unless the config says otherwise.
_QKV_BIAS_FAMILIES = frozenset({"qwen2", "qwen2_moe"})
# The config key that says so, where it is not `attention_bias`.
_QKV_BIAS_KEYS = {"qwen2_moe": "qkv_bias"}
# Families whose `attention_bias` also puts a bias on the O-projection, which is not supported.
_O_BIAS_FAMILIES = frozenset({"qwen3_moe"})
# Bytes of one element of a checkpoint dtype (`torch_dtype` in an HF config), for planners that
# size memory without torch.
_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
# What the simulator assumes of a preset whose config names no dtype: the usual serving precision.
DEFAULT_CHECKPOINT_DTYPE = "float16"


class ConfigError(ValueError):
    """A model or engine configuration that cannot be served."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 style frequency-dependent RoPE scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on Q, K and V projections (Qwen2)
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    checkpoint_dtype: str | None = None  # the HF config's `torch_dtype`; None when it names none
    qk_norm: bool = False  # RMSNorm over each Q and K head before RoPE (Qwen3)
    moe: MoeConfig | None = None  # routed experts in place of the MLP; None for a dense model

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        for attr in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "head_dim"):
            if getattr(self, attr) <= 0:
                raise ConfigError(f"{attr} must be positive, got {getattr(self, attr)}")

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def shape(self) -> ModelShape:
        """The numbers the scheduler's cost models and simulator compute with."""
        return ModelShape(num_layers=self.num_layers, hidden_size=self.hidden_size,
                          intermediate_size=self.intermediate_size, num_heads=self.num_heads,
                          num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, vocab_size=self.vocab_size,
                          tie_word_embeddings=self.tie_word_embeddings, attention_bias=self.attention_bias,
                          **self._moe_shape_fields())

    def _moe_shape_fields(self) -> dict[str, object]:
        """ModelShape's MoE numbers and the layers whose MLP is dense."""
        moe = self.moe
        if moe is None:
            return {}
        return dict(num_experts=moe.num_experts, num_experts_per_token=moe.num_experts_per_token,
                    expert_intermediate_size=moe.expert_intermediate_size,
                    shared_expert_intermediate_size=moe.shared_expert_intermediate_size,
                    dense_mlp_layers=tuple(moe.dense_layers))

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], name: str = "") -> "ModelConfig":
        archs = d.get("architectures") or ["LlamaForCausalLM"]
        arch = _ARCHITECTURES.get(archs[0])
        if arch is None:
            raise ConfigError(f"unsupported architecture {archs[0]!r}; supported: {sorted(_ARCHITECTURES)}")
        num_heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        num_layers = int(d["num_hidden_layers"])
        try:
            moe = MOE_FROM_HF[arch](d, num_layers) if arch in MOE_FROM_HF else None
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{archs[0]}: bad mixture-of-experts fields in the config ({e!r})") from e
        return cls(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(d.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=_qkv_bias(arch, d),
            rope_scaling=_parse_rope_scaling(d.get("rope_scaling") or d.get("rope_parameters")),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name or str(d.get("_name_or_path", "")),
            checkpoint_dtype=d.get("torch_dtype"),
            qk_norm=arch in _QK_NORM_FAMILIES,
            moe=moe,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "ModelConfig":
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise ConfigError(f"{cfg_path}: no config.json in the model directory")
        try:
            d = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{cfg_path}: not valid JSON ({e})") from e
        return cls.from_hf_dict(d, name=Path(path).name)

    @classmethod
    def from_preset(cls, name: str) -> "ModelConfig":
        path = PRESET_DIR / f"{name}.json"
        if not path.is_file():
            raise ConfigError(f"unknown model preset {name!r}; known: {list_presets()}")
        return cls.from_hf_dict(json.loads(path.read_text()), name=name)

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], name: str = "") -> "ModelConfig":
        """Build from GGUF key/values already decoded to Python values."""
        arch_name = meta.get("general.architecture")
        arch = _GGUF_ARCHITECTURES.get(arch_name)
        if arch is None:
            raise ConfigError(f"unsupported GGUF architecture {arch_name!r}; supported: {sorted(_GGUF_ARCHITECTURES)}")

        def get(key: str, default: Any = None) -> Any:
            return meta.get(f"{arch_name}.{key}", default)

        num_heads = int(get("attention.head_count"))
        hidden = int(get("embedding_length"))
        vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
        eos = meta.get("tokenizer.ggml.eos_token_id")
        scaling = None
        if get("rope.scaling.type") == "llama3" or get("rope.freq_factors") is not None:
            raise ConfigError("GGUF llama3 rope scaling is stored as rope_freqs; use the safetensors checkpoint")
        feed_forward_length = int(get("feed_forward_length", 0) or 0)
        try:
            moe = moe_from_gguf(arch_name, get, feed_forward_length)
        except (MoeConfigError, TypeError) as e:
            raise ConfigError(f"GGUF mixture-of-experts metadata: {e}") from e
        if moe is not None:
            arch = _GGUF_MOE_FAMILIES.get(arch_name, arch)
        return cls(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            # a MoE file may have no dense MLP width: its experts' stands in
            intermediate_size=feed_forward_length or (moe.expert_intermediate_size if moe else 0),
            num_layers=int(get("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(get("attention.head_count_kv", num_heads)),
            head_dim=int(get("attention.key_length", hidden // num_heads)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            max_position_embeddings=int(get("context_length", 2048)),
            # tied unless the file carries output.weight; the GGUF loader overrides this
            tie_word_embeddings=True,
            attention_bias=arch in _QKV_BIAS_FAMILIES,
            rope_scaling=scaling,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=(int(eos),) if eos is not None else (),
            name=name or str(meta.get("general.name", "")),
            qk_norm=arch in _QK_NORM_FAMILIES,
            moe=moe,
        )


def _qkv_bias(arch: str, d: Mapping[str, Any]) -> bool:
    """Whether Q, K and V carry a bias, from the family and its config."""
    if arch in _O_BIAS_FAMILIES and d.get("attention_bias"):
        raise ConfigError(f"{arch}: attention_bias puts a bias on the O-projection too, which is not supported")
    return bool(d.get(_QKV_BIAS_KEYS.get(arch, "attention_bias"), arch in _QKV_BIAS_FAMILIES))


def _parse_rope_scaling(d: Mapping[str, Any] | None) -> RopeScaling | None:
    if not d:
        return None
    rope_type = d.get("rope_type", d.get("type"))
    if rope_type in (None, "default"):
        return None
    if rope_type != "llama3":
        raise ConfigError(f"unsupported rope_scaling type {rope_type!r}; supported: 'llama3'")
    return RopeScaling(
        factor=float(d["factor"]),
        low_freq_factor=float(d["low_freq_factor"]),
        high_freq_factor=float(d["high_freq_factor"]),
        original_max_position_embeddings=int(d["original_max_position_embeddings"]),
    )


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def load_model_preset(name: str) -> tuple[ModelShape, int]:
    """A preset's shape (`configs/models/<name>.json`) and its checkpoint dtype's bytes per element,
    for the roofline model and the simulator."""
    config = ModelConfig.from_preset(name)
    dtype = config.checkpoint_dtype or DEFAULT_CHECKPOINT_DTYPE
    if dtype not in _DTYPE_BYTES:
        raise ConfigError(f"model preset {name!r}: unsupported torch_dtype {dtype!r}; "
                          f"supported: {sorted(_DTYPE_BYTES)}")
    return config.shape, _DTYPE_BYTES[dtype]
