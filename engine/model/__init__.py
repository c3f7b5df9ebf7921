"""The model: its configuration (torch-free), the Llama family as stages, the mixture-of-experts
families on the same stages, and their small layers.

`engine.model_config` imports no torch, so planners can read model shapes cheaply; the models
load on first use of `LlamaModel`, `MoeModel` or `create_model` (the class of a config's family).
"""
from importlib import import_module

from engine.model_config import PRESET_DIR, ConfigError, ModelConfig, RopeScaling, list_presets, load_model_preset

_LAZY = {"LlamaModel": "engine.model.llama", "LayerWeights": "engine.model.llama", "MoeModel": "engine.model.moe",
         "create_model": "engine.model.registry"}
__all__ = ["PRESET_DIR", "ConfigError", "ModelConfig", "RopeScaling", "list_presets", "load_model_preset", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine.model' has no attribute {name!r}")
