"""The compute dtype for `dtype="auto"`: measured, not guessed.

On a CPU, bf16 matmuls are only faster where the hardware has bf16 dot products (AVX512-BF16,
AMX, ARM BF16); elsewhere torch emulates them and they run slower than fp32. So `auto`
times one model-shaped matmul in both dtypes and keeps bf16 only if it clearly wins.
"""
from __future__ import annotations

import functools
import statistics
import time

import torch

# bf16 must beat fp32 by this factor; below it the accuracy of fp32 is worth more.
BF16_MIN_SPEEDUP = 1.3
_PROBE_TOKENS, _PROBE_DIM, _PROBE_REPS = 128, 1024, 5


@functools.lru_cache(maxsize=None)
def auto_dtype(device: str) -> torch.dtype:
    if torch.device(device).type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    fp32, bf16 = _time_matmul(torch.float32), _time_matmul(torch.bfloat16)
    return torch.bfloat16 if fp32 / bf16 >= BF16_MIN_SPEEDUP else torch.float32


def _time_matmul(dtype: torch.dtype) -> float:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(_PROBE_TOKENS, _PROBE_DIM, generator=gen).to(dtype)
    w = torch.randn(_PROBE_DIM, _PROBE_DIM, generator=gen).to(dtype)
    torch.nn.functional.linear(x, w)  # warm up the kernel selection
    times = []
    for _ in range(_PROBE_REPS):
        start = time.perf_counter()
        torch.nn.functional.linear(x, w)
        times.append(time.perf_counter() - start)
    return statistics.median(times)
