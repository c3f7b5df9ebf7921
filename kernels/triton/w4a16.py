"""W4A16 on CUDA: y = x @ W^T for kernels/cpu/int4.py's packed INT4 weights, in Triton.

The layout is int4.h's: `qweight` uint8 [n, k / 2], each run of 32 weights along k in 16 bytes,
byte i holding weight i in its low nibble and weight i + 16 in its high nibble; `scales` and
`mins` [n, k / group_size], fp32 or fp16 (GGUF Q4_0/Q4_1 store them as fp16, so keeping them so is
exact and halves their bytes: engine/quant/int4.py narrows them where that loses nothing);
weight = scale * q + min. Two kernels read it:

- `packed_linear`, for up to MAX_PACKED_ROWS rows of x (decode): the weight never exists as a
  matrix, and is read once whatever the rows. Decode is bound by reading the packed bytes, so the
  work is split over k as well as n (`PackedSchedule`): enough programs that every SM streams
  several tiles at batch 1, their fp32 partial sums added in a fixed order by a second small
  kernel (deterministic, unlike atomics). A tile's bytes are read once (evict-first: they are not
  read again), each group's scale and min once, and dequantized in registers. One row is an
  elementwise multiply and sum (tl.dot's smallest M is 16: fifteen rows of it would be padding);
  more rows go through tl.dot on the tensor cores. A byte's low nibble pairs with x[k] and its
  high nibble with x[k + 16], so x is read as two gathered halves and the weights never reordered.
- `dequantize_into`, for larger batches (prefill): W is written once, dense [n, k], into a buffer
  the caller keeps, and torch.matmul (cuBLAS on a GPU) multiplies it; the packed kernel would
  re-read and re-unpack W for every 16 rows.

`w4a16_linear` picks between them. Accumulation is fp32 and y comes out in x's dtype; for tl.dot
the unpacked weights are rounded to x's dtype, as the dense path's buffer is. The packed kernel's
schedule (tile sizes, split over k, warps) is chosen per (n, k, rows, dtype) by timing a few
candidates on first use and cached (`schedule_for`); under Triton's interpreter
(TRITON_INTERPRET=1 while this module is imported) the kernels run on CPU tensors, in fp32
throughout (the interpreter has no bf16 arithmetic), with one fixed schedule that still splits k.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:
    raise ImportError("kernels.triton.w4a16 needs the triton package (pyproject's test extra installs it)") from exc

from kernels.cpu.int4 import BLOCK, check_group_size

# Rows of x up to which `packed_linear` runs; above, `dequantize_into` and torch.matmul: from here
# on W is re-read per 16 rows, and cuBLAS on the dequantized matrix wins (docs/benchmarks.md's
# triton_w4a16 table shows both paths at every batch).
MAX_PACKED_ROWS = 16
DOT_ROWS = 16  # rows of x per program on the tensor-core path: tl.dot's smallest M

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
_PARAM_DTYPES = (torch.float32, torch.float16)  # of scales and mins


@dataclass(frozen=True)
class PackedSchedule:
    """How `packed_linear` cuts one problem: BLOCK_N rows of W by BLOCK_K weights per tile, k split
    into `split_k` runs of tiles (one program each per column tile and row block)."""

    block_n: int
    block_k: int  # a multiple of every group size (128 or more), so a tile holds whole groups
    split_k: int
    num_warps: int = 4
    num_stages: int = 3


# Candidate tiles (BLOCK_N, BLOCK_K, num_warps, num_stages) per path. One row: an elementwise
# [BLOCK_N, BLOCK_K / 2] fp32 accumulator, so narrow tiles with long runs of k; rows: tl.dot's
# [16, BLOCK_N] accumulator, BLOCK_N 16 or more.
_ROW_TILES = [(16, 256, 2, 3), (16, 512, 4, 3), (32, 256, 4, 3), (32, 512, 4, 3), (64, 128, 4, 3),
              (64, 256, 8, 3), (128, 128, 8, 3)]
_DOT_TILES = [(16, 256, 4, 3), (32, 128, 4, 3), (32, 256, 4, 3), (64, 128, 4, 3), (64, 256, 8, 3),
              (128, 128, 8, 4)]
# Programs per SM the split over k aims at: a few waves hide each program's ramp and tail; both
# are timed, the faster kept.
_PROGRAMS_PER_SM = (2, 8)
MAX_SPLIT_K = 32  # bounds the partial sums' buffer: [split_k, m, n] fp32
_TUNING_MS = (5, 25)  # do_bench's warm-up and timed spans per candidate: a first call costs ~2 s per shape
# Under the interpreter: one schedule, smaller than the test shapes' n and k so the edge masks run,
# and a pretend SM count that makes it split k, so the reduction runs too.
_INTERPRETED_TILE = (64, 128, 4, 3)
_INTERPRETED_NUM_SMS = 4

_schedules: dict[tuple, PackedSchedule] = {}  # (n, k, row block, x dtype, group size, device) -> the fastest


def split_for(n: int, k: int, num_rows: int, block_m: int, block_n: int, block_k: int, num_sms: int,
              programs_per_sm: int) -> int:
    """How many runs of k tiles give about programs_per_sm programs per SM, with no empty run."""
    num_tiles = triton.cdiv(n, block_n) * triton.cdiv(num_rows, block_m)
    num_k_tiles = triton.cdiv(k, block_k)
    wanted = max(1, min(MAX_SPLIT_K, num_k_tiles, round(programs_per_sm * num_sms / num_tiles)))
    return triton.cdiv(num_k_tiles, triton.cdiv(num_k_tiles, wanted))


def candidates(n: int, k: int, num_rows: int, num_sms: int) -> list[PackedSchedule]:
    """The schedules timed for one problem (duplicates dropped)."""
    block_m = row_block(num_rows)
    tiles = _ROW_TILES if block_m == 1 else _DOT_TILES
    found = {PackedSchedule(block_n, block_k, split_for(n, k, num_rows, block_m, block_n, block_k, num_sms, per_sm),
                            num_warps, num_stages)
             for (block_n, block_k, num_warps, num_stages), per_sm in itertools.product(tiles, _PROGRAMS_PER_SM)}
    return sorted(found, key=lambda s: (s.block_n, s.block_k, s.split_k, s.num_warps))


def row_block(num_rows: int) -> int:
    """Rows per program: 1 (the elementwise path) for one row, else tl.dot's 16."""
    return 1 if num_rows == 1 else DOT_ROWS


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _packed_linear_kernel(x_ptr, qweight_ptr, scales_ptr, mins_ptr, y_ptr, partial_ptr, M, N, K, K_PER_RUN,
                          stride_xm, stride_xk, GROUP_SIZE: tl.constexpr, DOT_DTYPE: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          SPLIT_K: tl.constexpr):
    # One program: BLOCK_M rows of x against BLOCK_N rows of W over one run of k tiles; into y
    # itself when k is not split, else into this run's slice of the partial sums.
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    row_mask = rows < M
    col_mask = cols < N
    half_k = K // 2
    num_groups = K // GROUP_SIZE
    first_k = tl.program_id(1) * K_PER_RUN  # K_PER_RUN: a multiple of BLOCK_K
    last_k = tl.where(first_k + K_PER_RUN < K, first_k + K_PER_RUN, K)
    GROUPS_PER_TILE: tl.constexpr = BLOCK_K // GROUP_SIZE
    tile_bytes = tl.arange(0, BLOCK_K // 2)  # [BLOCK_K / 2]
    # The weight in byte b's low nibble: block b // 16, place b % 16 (its high nibble: 16 on).
    tile_low_k = (tile_bytes // BYTES_PER_BLOCK) * WEIGHTS_PER_BLOCK + tile_bytes % BYTES_PER_BLOCK
    tile_groups = tl.arange(0, GROUPS_PER_TILE)  # a group's G weights are G / 2 consecutive bytes
    if BLOCK_M == 1:
        acc = tl.full((BLOCK_N, BLOCK_K // 2), 0.0, dtype=tl.float32)  # summed over k at the end
    else:
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    for start in range(first_k, last_k, BLOCK_K):
        byte_index = start // 2 + tile_bytes
        byte_mask = byte_index < half_k  # whole blocks: k and BLOCK_K are multiples of 32
        packed = tl.load(qweight_ptr + cols[:, None] * half_k + byte_index[None, :],
                         mask=col_mask[:, None] & byte_mask[None, :], other=0,
                         eviction_policy="evict_first")  # [BLOCK_N, BLOCK_K / 2] uint8
        group_index = start // GROUP_SIZE + tile_groups  # [GROUPS_PER_TILE]
        group_offsets = cols[:, None] * num_groups + group_index[None, :]
        group_mask = col_mask[:, None] & (group_index < num_groups)[None, :]
        scale = tl.load(scales_ptr + group_offsets, mask=group_mask, other=0.0).to(tl.float32)[:, :, None]
        minimum = tl.load(mins_ptr + group_offsets, mask=group_mask, other=0.0).to(tl.float32)[:, :, None]
        codes = tl.reshape(packed, (BLOCK_N, GROUPS_PER_TILE, GROUP_SIZE // 2))
        w_low = tl.reshape((codes & LOW_NIBBLE).to(tl.float32) * scale + minimum, (BLOCK_N, BLOCK_K // 2))
        w_high = tl.reshape((codes >> NIBBLE_BITS).to(tl.float32) * scale + minimum, (BLOCK_N, BLOCK_K // 2))
        low_k = start + tile_low_k  # [BLOCK_K / 2]
        x_low_ptrs = x_ptr + rows[:, None] * stride_xm + low_k[None, :] * stride_xk  # [BLOCK_M, BLOCK_K / 2]
        x_mask = row_mask[:, None] & byte_mask[None, :]
        x_low = tl.load(x_low_ptrs, mask=x_mask, other=0.0)
        x_high = tl.load(x_low_ptrs + BYTES_PER_BLOCK * stride_xk, mask=x_mask, other=0.0)
        if BLOCK_M == 1:
            acc += w_low * x_low.to(tl.float32) + w_high * x_high.to(tl.float32)
        else:
            # "ieee" keeps fp32 operands out of TF32; bf16/fp16 operands ignore it.
            acc = tl.dot(x_low.to(DOT_DTYPE), tl.trans(w_low.to(DOT_DTYPE)), acc, input_precision="ieee")
            acc = tl.dot(x_high.to(DOT_DTYPE), tl.trans(w_high.to(DOT_DTYPE)), acc, input_precision="ieee")
    if BLOCK_M == 1:
        result = tl.reshape(tl.reduce(acc, 1, _add), (1, BLOCK_N))  # tl.sum, in builtins (see above)
    else:
        result = acc
    out_offsets = rows[:, None] * N + cols[None, :]
    out_mask = row_mask[:, None] & col_mask[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptr + out_offsets, result.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(partial_ptr + tl.program_id(1) * M * N + out_offsets, result, mask=out_mask)


@triton.jit
def _sum_splits_kernel(partial_ptr, y_ptr, NUM_OUTPUTS, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    # y = the sum of the SPLIT_K partial sums [SPLIT_K, m * n], in order: the same bits every run.
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < NUM_OUTPUTS
    total = tl.full((BLOCK,), 0.0, dtype=tl.float32)
    for split in range(SPLIT_K):
        total += tl.load(partial_ptr + split * NUM_OUTPUTS + offsets, mask=mask, other=0.0)
    tl.store(y_ptr + offsets, total.to(y_ptr.dtype.element_ty), mask=mask)


SUM_BLOCK = 1024  # outputs per program of the reduction

# Dequantizing is elementwise and bound by writing the dense matrix: wide tiles, rows of k.
_DEQUANTIZE_CONFIGS = [
    triton.Config({"BLOCK_N": block_n, "BLOCK_K": block_k}, num_warps=num_warps)
    for block_n, block_k, num_warps in [
        (16, 512, 4), (16, 1024, 8), (32, 256, 4), (32, 512, 8), (64, 256, 8), (8, 2048, 8),
    ]
]
# Under the interpreter every program instance runs in Python, so few large tiles; still smaller
# than the test shapes' n and k, so that the edge masks run.
_DEQUANTIZE_META = {"BLOCK_N": 64, "BLOCK_K": 128} if INTERPRETED else {}


def _autotuned(configs: list):
    """triton.autotune over `configs` (the best per (N, K, dtypes) is kept) when compiling for a
    GPU; under the interpreter the kernel as it is, launched with _DEQUANTIZE_META."""
    if INTERPRETED:
        return lambda kernel: kernel
    return triton.autotune(configs=configs, key=["N", "K"])


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
    scale = tl.load(scales_ptr + group_offsets, mask=mask, other=0.0).to(tl.float32)
    minimum = tl.load(mins_ptr + group_offsets, mask=mask, other=0.0).to(tl.float32)
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
        _check_tensor(name, tensor, 2, _PARAM_DTYPES, qweight.device)
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
                  group_size: int, out: torch.Tensor | None = None,
                  schedule: PackedSchedule | None = None) -> torch.Tensor:
    """y = x @ W^T with W unpacked in registers: x [m, k] fp32/bf16/fp16 -> y [m, n] in x's
    dtype (into `out` if given), on `schedule` (default: `schedule_for`'s). Right for m up to
    MAX_PACKED_ROWS, correct for any m. Raises ValueError on malformed input."""
    _check_x(x, qweight)
    n, k = _check_weight(qweight, scales, mins, group_size, x.device)
    m = x.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        _check_out("out", out, (m, n), x.dtype, x.device)
    if m == 0 or n == 0:
        return out
    if schedule is None:
        schedule = schedule_for(x, qweight, scales, mins, group_size)
    _launch(x, qweight, scales, mins, group_size, out, schedule)
    return out


def _launch(x, qweight, scales, mins, group_size: int, out: torch.Tensor, schedule: PackedSchedule) -> None:
    m, n, k = x.shape[0], qweight.shape[0], qweight.shape[1] * 2
    block_m = row_block(m)
    split = schedule.split_k
    # [split, m, n] fp32 partial sums where k is split; the kernel never touches it otherwise
    partial = torch.empty((split, m, n) if split > 1 else (1,), dtype=torch.float32, device=x.device)
    k_per_run = triton.cdiv(triton.cdiv(k, schedule.block_k), split) * schedule.block_k
    grid = (triton.cdiv(n, schedule.block_n), split, triton.cdiv(m, block_m))
    _packed_linear_kernel[grid](x, qweight, scales, mins, out, partial, m, n, k, k_per_run, x.stride(0), x.stride(1),
                                GROUP_SIZE=group_size, DOT_DTYPE=tl.float32 if INTERPRETED else _X_DTYPES[x.dtype],
                                BLOCK_M=block_m, BLOCK_N=schedule.block_n, BLOCK_K=schedule.block_k, SPLIT_K=split,
                                num_warps=schedule.num_warps, num_stages=schedule.num_stages)
    if split > 1:
        _sum_splits_kernel[(triton.cdiv(m * n, SUM_BLOCK),)](partial, out, m * n, SPLIT_K=split, BLOCK=SUM_BLOCK)


def schedule_for(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                 group_size: int) -> PackedSchedule:
    """The packed kernel's schedule for this problem: under the interpreter the fixed one; on a GPU
    the fastest of `candidates`, timed on the first call for its (n, k, row block, dtypes, group
    size, device) and kept for the process. While a CUDA graph is being captured nothing can be
    timed: an untimed problem then takes the first candidate (the engine runs each shape eagerly
    before it captures, so this is the exception)."""
    m, n, k = x.shape[0], qweight.shape[0], qweight.shape[1] * 2
    if INTERPRETED:
        block_n, block_k, num_warps, num_stages = _INTERPRETED_TILE
        split = split_for(n, k, m, row_block(m), block_n, block_k, _INTERPRETED_NUM_SMS, _PROGRAMS_PER_SM[0])
        return PackedSchedule(block_n, block_k, split, num_warps, num_stages)
    key = (n, k, row_block(m), x.dtype, scales.dtype, mins.dtype, group_size, x.device)
    if key not in _schedules:
        num_sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        options = candidates(n, k, m, num_sms)
        if torch.cuda.is_current_stream_capturing():
            return options[0]
        _schedules[key] = _fastest(options, x, qweight, scales, mins, group_size)
    return _schedules[key]


def _fastest(options: list[PackedSchedule], x, qweight, scales, mins, group_size: int) -> PackedSchedule:
    from triton.testing import do_bench

    out = torch.empty(x.shape[0], qweight.shape[0], dtype=x.dtype, device=x.device)
    warmup_ms, rep_ms = _TUNING_MS
    times = {schedule: do_bench(lambda: _launch(x, qweight, scales, mins, group_size, out, schedule),
                                warmup=warmup_ms, rep=rep_ms, return_mode="median")
             for schedule in options}
    return min(times, key=times.get)


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
