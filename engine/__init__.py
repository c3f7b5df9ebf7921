"""tandem's model side: configs, weights, the Llama model, KV cache, runner, sampler, engine.

The public names load lazily so that importing one submodule (say engine.sampling) does not
pull in the whole engine.
"""
from importlib import import_module

import kernels  # noqa: F401  (before torch: caps torch's OpenMP spinning, see kernels/__init__.py)

_EXPORTS = {
    "LLM": "engine.llm",
    "LLMEngine": "engine.engine",
    "EngineConfig": "engine.config",
    "RequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
    "SamplingParams": "scheduler.sampling_params",
    "ParamError": "scheduler.sampling_params",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
