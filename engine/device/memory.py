"""How much of a CUDA device the engine takes where no budget is given: one rule, GPU_MEMORY_FRACTION
of the device's total memory (vLLM's), for the fit's GPU budget (engine/planning/fit.py) and for
the memory the KV pool takes what the weights leave of (engine/engine.py, engine/planning/weights.py)."""
from __future__ import annotations

import torch

from engine.config import GPU_MEMORY_FRACTION


def default_gpu_memory_bytes(torch_device: str) -> int:
    """GPU_MEMORY_FRACTION of the CUDA device's total memory, in bytes."""
    return int(GPU_MEMORY_FRACTION * torch.cuda.get_device_properties(torch_device).total_memory)
