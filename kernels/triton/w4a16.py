"""W4A16 on CUDA: y = x @ W^T for kernels/cpu/int4.py's packed INT4 weights, in Triton.

The layout is int4.h's: `qweight` uint8 [n, k / 2], each run of 32 weights along k in 16 bytes,
byte i holding weight i in its low nibble and weight i + 16 in its high nibble; `scales` and
`mins` fp32 [n, k / group_size], weight = scale * q + min. Two kernels read it:

- `packed_linear`, for up to MAX_PACKED_ROWS rows of x (decode): the weight never exists as a
  matrix. Each program loads a tile of packed bytes, unpacks and scales it in registers and
  multiplies it with x on the tensor cores (PIPO's path that skips dequantization). A byte's low
  nibble pairs with x[k] and its high nibble with x[k + 16], so x is read as two gathered halves
  and the unpacked weights are never reordered.
- `dequantize_into`, for larger batches (prefill): W is written once, dense [n, k], into a buffer
  the caller keeps, and torch.matmul (cuBLAS on a GPU) multiplies it; the packed kernel would
  re-read and re-unpack W for every 16 rows.

`w4a16_linear` picks between them. Accumulation is fp32 and y comes out in x's dtype; the
unpacked weights are rounded to x's dtype for the tensor cores, as the dense path's buffer is.
Under Triton's interpreter (TRITON_INTERPRET=1 while this module is imported) the same kernels
run on CPU tensors, in fp32 throughout (the interpreter has no bf16 arithmetic) and with fixed
block sizes instead of autotuning (nothing to time, and every config would run).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:
    raise ImportError("kernels.triton.w4a16 needs the triton package (pyproject's test extra installs it)") from exc

from kernels.cpu.int4 import BLOCK, check_group_size

# Rows of x up to which `packed_linear` runs; above, `dequantize_into` and torch.matmul. Sixteen
# rows are one tile of tl.dot (its smallest M), so up to here W is read and unpacked once
# whatever the batch. A first choice, not yet measured on a GPU (benchmarks/kernels/triton_w4a16.py).
MAX_PACKED_ROWS = 16
PACKED_BLOCK_M = 16  # rows of x per program of the packed kernel: tl.dot's smallest M

# The layout inside the kernels (jit code may only read globals that are constexpr).
WEIGHTS_PER_BLOCK = tl.constexpr(BLOCK)  # weights per 16-byte block
BYTES_PER_BLOCK = tl.constexpr(BLOCK // 2)  # also how far a byte's high weight is from its low one
LOW_NIBBLE = tl.constexpr(0xF)
NIBBLE_BITS = tl.constexpr(4)

# As triton.jit read it when it decorated the kernels below. The kernels call triton.language's
# builtins only (tl.full, not tl.zeros): the functions of its standard library are @triton.jit
# code themselves, interpreted only if triton itself was imported under TRITON_INTERPRET, and
# the tests switch the interpreter on for this module alone (tests/conftest.py).
INTERPRETED: bool = triton.knobs.runtime.interpret

_X_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

# H100 candidates. Decode is bound by reading the packed bytes, so the packed kernel wants enough
# programs to cover the 132 SMs (N / BLOCK_N of them at batch <= 16: narrow tiles) and long
# runs along k per row; a [BLOCK_N, BLOCK_K / 2] tile holds four fp32 arrays (weights, scales,
# mins, codes) in registers, which caps BLOCK_N * BLOCK_K per warp count.
_PACKED_CONFIGS = [
    triton.Config({"BLOCK_N": block_n, "BLOCK_K": block_k}, num_warps=num_warps, num_stages=num_stages)
    for block_n, block_k, num_warps, num_stages in [
        (16, 256, 4, 4), (16, 512, 4, 3), (32, 128, 4, 4), (32, 256, 4, 3),
        (32, 512, 8, 3), (64, 128, 4, 3), (64, 256, 8, 3), (128, 128, 8, 3),
    ]
]
# Dequantizing is elementwise and bound by writing the dense matrix: wide tiles, rows of k.
_DEQUANTIZE_CONFIGS = [
    triton.Config({"BLOCK_N": block_n, "BLOCK_K": block_k}, num_warps=num_warps)
    for block_n, block_k, num_warps in [
        (16, 512, 4), (16, 1024, 8), (32, 256, 4), (32, 512, 8), (64, 256, 8), (8, 2048, 8),
    ]
]
# Under the interpreter every program instance runs in Python, so few large tiles; still smaller
# than the test shapes' n and k, so that the edge masks run.
_INTERPRETED_META = {"BLOCK_N": 64, "BLOCK_K": 128}
_PACKED_META = _INTERPRETED_META if INTERPRETED else {}
_DEQUANTIZE_META = _INTERPRETED_META if INTERPRETED else {}


def _autotuned(configs: list):
    """triton.autotune over `configs` (the best per (N, K, dtypes) is kept) when compiling for a
    GPU; under the interpreter the kernel as it is, launched with _INTERPRETED_META."""
    if INTERPRETED:
        return lambda kernel: kernel
    return triton.autotune(configs=configs, key=["N", "K"])


@_autotuned(_PACKED_CONFIGS)
@triton.jit
def _packed_linear_kernel(x_ptr, qweight_ptr, scales_ptr, mins_ptr, y_ptr, M, N, K, stride_xm, stride_xk,
                          GROUP_SIZE: tl.constexpr, DOT_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # One program: y[rows, cols] for BLOCK_M rows of x and BLOCK_N rows of W, over all of k.
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    row_mask = rows < M
    col_mask = cols < N
    half_k = K // 2
    num_groups = K // GROUP_SIZE
    tile_bytes = tl.arange(0, BLOCK_K // 2)  # [BLOCK_K / 2]
    # The weight in byte b's low nibble: block b // 16, place b % 16 (its high nibble: 16 on).
    tile_low_k = (tile_bytes // BYTES_PER_BLOCK) * WEIGHTS_PER_BLOCK + tile_bytes % BYTES_PER_BLOCK
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        byte_index = start // 2 + tile_bytes
        byte_mask = byte_index < half_k  # whole blocks: k and BLOCK_K are multiples of 32
        low_k = start + tile_low_k  # [BLOCK_K / 2]
        w_mask = col_mask[:, None] & byte_mask[None, :]
        packed = tl.load(qweight_ptr + cols[:, None] * half_k + byte_index[None, :],
                         mask=w_mask, other=0)  # [BLOCK_N, BLOCK_K / 2] uint8
        group_offsets = cols[:, None] * num_groups + (low_k // GROUP_SIZE)[None, :]
        scale = tl.load(scales_ptr + group_offsets, mask=w_mask, other=0.0)
        minimum = tl.load(mins_ptr + group_offsets, mask=w_mask, other=0.0)
        w_low = ((packed & LOW_NIBBLE).to(tl.float32) * scale + minimum).to(DOT_DTYPE)
        w_high = ((packed >> NIBBLE_BITS).to(tl.float32) * scale + minimum).to(DOT_DTYPE)
        x_mask = row_mask[:, None] & byte_mask[None, :]
        x_low_ptrs = x_ptr + rows[:, None] * stride_xm + low_k[None, :] * stride_xk  # [BLOCK_M, BLOCK_K / 2]
        x_low = tl.load(x_low_ptrs, mask=x_mask, other=0.0).to(DOT_DTYPE)
        x_high = tl.load(x_low_ptrs + BYTES_PER_BLOCK * stride_xk, mask=x_mask, other=0.0).to(DOT_DTYPE)
        # "ieee" keeps fp32 operands out of TF32; bf16/fp16 operands ignore it.
        acc = tl.dot(x_low, tl.trans(w_low), acc, input_precision="ieee")
        acc = tl.dot(x_high, tl.trans(w_high), acc, input_precision="ieee")
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


@_autotuned(_DEQUANTIZE_CONFIGS)
@triton.jit
def _dequantize_kernel(qweight_ptr, scales_ptr, mins_ptr, out_ptr, N, K, GROUP_SIZE: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # One program: out[cols, BLOCK_K weights of k] from BLOCK_K / 2 packed bytes of each row.
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    byte_index = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)  # [BLOCK_K / 2]
    half_k = K // 2
    mask = (cols < N)[:, None] & (byte_index < half_k)[None, :]
    packed = tl.load(qweight_ptr + cols[:, None] * half_k + byte_index[None, :], mask=mask, other=0)
    low_k = (byte_index // BYTES_PER_BLOCK) * WEIGHTS_PER_BLOCK + byte_index % BYTES_PER_BLOCK
    group_offsets = cols[:, None] * (K // GROUP_SIZE) + (low_k // GROUP_SIZE)[None, :]
    scale = tl.load(scales_ptr + group_offsets, mask=mask, other=0.0)
    minimum = tl.load(mins_ptr + group_offsets, mask=mask, other=0.0)
    w_low = (packed & LOW_NIBBLE).to(tl.float32) * scale + minimum
    w_high = (packed >> NIBBLE_BITS).to(tl.float32) * scale + minimum
    out_low_ptrs = out_ptr + cols[:, None] * K + low_k[None, :]  # runs of 16 contiguous weights
    tl.store(out_low_ptrs, w_low.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_low_ptrs + BYTES_PER_BLOCK, w_high.to(out_ptr.dtype.element_ty), mask=mask)


def _check_tensor(name: str, tensor, ndim: int, dtypes, device: torch.device | None = None) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(tensor.shape)}")
    if tensor.dtype not in dtypes:
        raise ValueError(f"{name} dtype must be one of {[str(d) for d in dtypes]}, got {tensor.dtype}")
    if device is not None and tensor.device != device:
        raise ValueError(f"{name} must be on {device} with the other tensors, got {tensor.device}")


def _check_contiguous(name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_shape(name: str, tensor: torch.Tensor, shape: tuple) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(tensor.shape)}")


def _check_weight(qweight, scales, mins, group_size: int, device: torch.device | None) -> tuple[int, int]:
    """The packed weight's (n, k), after checking its three tensors agree with each other."""
    _check_tensor("qweight", qweight, 2, (torch.uint8,), device)
    _check_contiguous("qweight", qweight)
    n, k = qweight.shape[0], qweight.shape[1] * 2
    check_group_size(group_size, k)
    for name, tensor in (("scales", scales), ("mins", mins)):
        _check_tensor(name, tensor, 2, (torch.float32,), qweight.device)
        _check_contiguous(name, tensor)
        _check_shape(name, tensor, (n, k // group_size))
    return n, k


def _check_out(name: str, out, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    _check_tensor(name, out, len(shape), (dtype,), device)
    _check_contiguous(name, out)
    _check_shape(name, out, shape)


def _check_x(x, qweight) -> None:
    _check_tensor("x", x, 2, _X_DTYPES)
    if isinstance(qweight, torch.Tensor) and qweight.dim() == 2 and x.shape[1] != qweight.shape[1] * 2:
        raise ValueError(f"x has {x.shape[1]} columns but qweight packs {qweight.shape[1] * 2} (k / 2 bytes a row)")


def dequantize_into(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int,
                    out: torch.Tensor) -> torch.Tensor:
    """W's rows [n, k] written into `out` (fp32, bf16 or fp16, contiguous, on qweight's device).
    Returns `out`. Raises ValueError on malformed input."""
    _check_tensor("out", out, 2, _X_DTYPES)
    n, k = _check_weight(qweight, scales, mins, group_size, out.device)
    _check_out("out", out, (n, k), out.dtype, out.device)
    if n == 0:
        return out

    def grid(meta):
        return triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(k, meta["BLOCK_K"])

    _dequantize_kernel[grid](qweight, scales, mins, out, n, k, GROUP_SIZE=group_size, **_DEQUANTIZE_META)
    return out


def packed_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                  group_size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T with W unpacked in registers: x [m, k] fp32/bf16/fp16 -> y [m, n] in x's
    dtype (into `out` if given). Right for m up to MAX_PACKED_ROWS, correct for any m. Raises
    ValueError on malformed input."""
    _check_x(x, qweight)
    n, k = _check_weight(qweight, scales, mins, group_size, x.device)
    m = x.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        _check_out("out", out, (m, n), x.dtype, x.device)
    if m == 0 or n == 0:
        return out
    dot_dtype = tl.float32 if INTERPRETED else _X_DTYPES[x.dtype]

    def grid(meta):
        return triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, PACKED_BLOCK_M)

    _packed_linear_kernel[grid](x, qweight, scales, mins, out, m, n, k, x.stride(0), x.stride(1),
                                GROUP_SIZE=group_size, DOT_DTYPE=dot_dtype, BLOCK_M=PACKED_BLOCK_M, **_PACKED_META)
    return out


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                 group_size: int, out: torch.Tensor | None = None, dense: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T for packed W: x [m, k] fp32/bf16/fp16 -> y [m, n] in x's dtype (into `out`
    if given). Up to MAX_PACKED_ROWS rows the packed kernel; above, W dequantized into `dense`
    ([n, k] in x's dtype, contiguous: a buffer the caller reuses across calls; allocated here if
    None) and torch.matmul. Raises ValueError on malformed input."""
    _check_x(x, qweight)
    n, k = _check_weight(qweight, scales, mins, group_size, x.device)
    if dense is not None:
        _check_out("dense", dense, (n, k), x.dtype, x.device)
    if x.shape[0] <= MAX_PACKED_ROWS:
        return packed_linear(x, qweight, scales, mins, group_size, out=out)
    if out is not None:
        _check_out("out", out, (x.shape[0], n), x.dtype, x.device)
    if dense is None:
        dense = torch.empty(n, k, dtype=x.dtype, device=x.device)
    dequantize_into(qweight, scales, mins, group_size, dense)
    return torch.matmul(x, dense.T, out=out)
