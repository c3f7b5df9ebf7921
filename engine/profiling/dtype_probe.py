"""The compute dtype for `dtype="auto"`: measured, not guessed.

On a CPU, bf16 matmuls are only faster where the hardware has bf16 dot products (AVX512-BF16,
AMX, ARM BF16); elsewhere torch emulates them and they run slower than fp32. So `auto`
times one model-shaped matmul in both dtypes and keeps bf16 only if it clearly wins.
"""
from __future__ import annotations

import functools
import time

import torch

from engine.config import DTYPE_NAMES

# bf16 must beat fp32 by this factor; below it the accuracy of fp32 is worth more.
BF16_MIN_SPEEDUP = 1.3
_PROBE_TOKENS, _PROBE_DIM, _PROBE_REPS = 128, 1024, 9


def compute_dtype(name: str, device: str) -> tuple[torch.dtype, str]:
    """The torch dtype an `EngineConfig.dtype` name stands for on `device`, and why (for the log):
    `auto` is measured (`auto_dtype`), any other name is taken as given."""
    if name == "auto":
        return auto_dtype(device)
    return getattr(torch, DTYPE_NAMES[name]), "as configured"


# Once per process and device: every engine of a process runs on the same hardware.
@functools.lru_cache(maxsize=None)
def auto_dtype(device: str) -> tuple[torch.dtype, str]:
    """The compute dtype for `dtype="auto"` on `device`, and the measurement behind the choice."""
    if torch.device(device).type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "auto: this GPU supports bf16"
        return torch.float16, "auto: this GPU lacks bf16"
    fp32, bf16 = probe_matmul_times()
    speedup = fp32 / bf16
    dtype = torch.bfloat16 if speedup >= BF16_MIN_SPEEDUP else torch.float32
    return dtype, f"auto: bf16 matmul {speedup:.2f}x fp32's speed on this CPU; bf16 needs {BF16_MIN_SPEEDUP}x"


def probe_matmul_times() -> tuple[float, float]:
    """Best-of-N seconds of one model-shaped matmul in fp32 and in bf16, interleaved.

    The minimum, not the median: on a shared machine other work only ever adds time, so the
    fastest run is the closest to what the hardware does."""
    gen = torch.Generator().manual_seed(0)
    operands = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(_PROBE_TOKENS, _PROBE_DIM, generator=gen).to(dtype)
        w = torch.randn(_PROBE_DIM, _PROBE_DIM, generator=gen).to(dtype)
        torch.nn.functional.linear(x, w)  # warm up the kernel selection
        operands[dtype] = (x, w)
    times: dict[torch.dtype, list[float]] = {dtype: [] for dtype in operands}
    for _ in range(_PROBE_REPS):
        for dtype, (x, w) in operands.items():
            start = time.perf_counter()
            torch.nn.functional.linear(x, w)
            times[dtype].append(time.perf_counter() - start)
    return min(times[torch.float32]), min(times[torch.bfloat16])
