"""Triton kernels for CUDA devices: `kernels.triton.w4a16`, the INT4 weight-only GEMM over
kernels/cpu/int4.py's packed layout.

This package imports nothing from triton itself: the engine imports `kernels.triton.w4a16` only
for a weight that lives on a CUDA device, so the CPU-only engine runs where triton is absent.
The kernels also run on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1 while
kernels.triton.w4a16 is imported), which is how tests/kernels checks them without a GPU.
"""
from __future__ import annotations

import importlib.util


def is_available() -> bool:
    """Whether the triton package is installed (a GPU to run on is another matter)."""
    return importlib.util.find_spec("triton") is not None
