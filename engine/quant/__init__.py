"""Linear methods: how a weight is stored and multiplied (dense, INT4).."""
from engine.quant.base import (
    LinearMethod,
    LinearWeight,
    create_linear_method,
    linear_method_names,
    register_linear_method,
)

# Imported for their @register_linear_method side effect.
from engine.quant import dense, int4  # noqa: E402,F401  isort: skip

__all__ = ["LinearMethod", "LinearWeight", "create_linear_method", "linear_method_names",
           "register_linear_method"]
