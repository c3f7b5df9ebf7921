"""Which model class runs a family (ModelConfig.architecture, itself read from the HF
`architectures` name or the GGUF architecture): a name registry, filled by the model modules."""
from __future__ import annotations

from importlib import import_module

from engine.model_config import ModelConfig
from engine.registry import Registry

MODELS: Registry = Registry("model family")
# Class decorator: `name` (a family) is run by this model class.
register_model = MODELS.register
# The modules whose classes register themselves, imported on the first create_model.
_MODEL_MODULES = ("engine.model.llama", "engine.model.moe")


def create_model(config: ModelConfig, *args, **kwargs):
    """The model of `config`'s family, built as cls(config, *args, **kwargs) (LlamaModel's arguments)."""
    for module in _MODEL_MODULES:
        import_module(module)
    return MODELS.create(config.architecture, config, *args, **kwargs)
