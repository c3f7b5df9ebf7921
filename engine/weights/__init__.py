"""Weight loaders: GGUF files, Hugging Face safetensors directories, and random weights.

`create_loader(model, load_format)` picks one; each hands out weights one layer at a time.
"""
from engine.weights.base import (
    EMBEDDED_MODEL,
    LOAD_FORMATS,
    WeightLoader,
    WeightLoadError,
    create_loader,
    embedded_gguf_path,
    expert_prefix,
    global_shapes,
    layer_shapes,
    register_loader,
)

# Imported for their @register_loader side effect.
from engine.weights import dummy, gguf_loader, safetensors_loader  # noqa: E402,F401  isort: skip

__all__ = [
    "EMBEDDED_MODEL",
    "LOAD_FORMATS",
    "WeightLoader",
    "WeightLoadError",
    "create_loader",
    "embedded_gguf_path",
    "expert_prefix",
    "global_shapes",
    "layer_shapes",
    "register_loader",
]
