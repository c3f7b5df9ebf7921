"""How close a Triton kernel's half-precision output must come to its fp32/fp64 reference."""
from __future__ import annotations

import torch


def assert_half_close(got: torch.Tensor, want: torch.Tensor, device: str, dtype: torch.dtype) -> None:
    """Interpreted ("cpu"): fp32 inside, the output rounded (truncated by the interpreter) to
    `dtype`: 2 eps. CUDA: the dots in `dtype` too and the softmax weights rounded to it (eps / 2
    each): 2 eps of max |want|, some 4 times the worst of an emulation of that rounding over 100-200
    draws."""
    eps = torch.finfo(dtype).eps
    got = got.to(want.dtype)
    if device == "cpu":
        torch.testing.assert_close(got, want, atol=2 * eps, rtol=2 * eps)
    else:
        torch.testing.assert_close(got, want, atol=2 * eps * float(want.abs().max()), rtol=0)
