"""CPU paged decode attention: a C++ SIMD kernel for the decode step's attention.

The compiled extension (`_cpu_kernels`: this attention and the INT4 matmul of kernels/cpu/int4.py) is built by `python -m kernels.cpu.build`.
Caches are per layer: values `[num_blocks, num_kv_heads, block_size, head_dim]`, keys transposed
within a block, `[num_blocks, num_kv_heads, head_dim, block_size]` (a vector load then takes one
element of several tokens, so scores need no horizontal sums); fp32, bf16 or fp16, or the
group-quantized INT8/INT4 units of kernels/kv_quant.py, arithmetic in fp32. kernels.cpu.reference
holds the torch ground truth.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from typing import Callable

import torch

from kernels import kv_quant

BUILD_COMMAND = ".venv/bin/python -m kernels.cpu.build"

try:
    from kernels.cpu import _cpu_kernels as _ext

    _IMPORT_ERROR: ImportError | None = None
except ImportError as exc:
    _ext = None
    _IMPORT_ERROR = exc

# Codes of tandem::DType in attention.h.
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# A quantized pool's block_size must be a multiple of this (kv_quant.h: whole vectors of scales).
QUANTIZED_BLOCK_MULTIPLE = 16

# Calibration problem for default_num_threads: a Llama-3-8B layer (8 kv heads
# of 128, 4 query heads each) over 16 x 1024 tokens of bf16 KV, 64 MiB, larger
# than the last-level caches of common CPUs so it measures memory, not cache.
_CALIBRATION_BATCH = 16
_CALIBRATION_CONTEXT = 1024
_CALIBRATION_KV_HEADS = 8
_CALIBRATION_GROUP = 4
_CALIBRATION_HEAD_DIM = 128
_CALIBRATION_BLOCK = 16
_CALIBRATION_REPS = 3
# More threads must be at least this much faster to be preferred over fewer.
_CALIBRATION_MARGIN = 0.05


def is_available() -> bool:
    """Whether the compiled extension imports."""
    return _ext is not None


def _extension():
    if _ext is None:
        raise RuntimeError(f"the CPU kernels extension is not built ({_IMPORT_ERROR}); run `{BUILD_COMMAND}`")
    return _ext


def usable_isas() -> list[str]:
    """Kernel instruction sets compiled in and supported by this CPU, best first."""
    return list(_extension().usable_isas())


_default_isa = ""  # "": the best usable; using_isa() names another for calls that name none


@contextlib.contextmanager
def using_isa(isa: str):
    """Within the block, kernel calls that name no `isa` run the one named here (a usable_isas()
    entry): a whole engine on another instruction set's kernels, as the accuracy benchmark runs
    the decode attention with and without integer dot products."""
    global _default_isa
    if isa not in usable_isas():
        raise ValueError(f"isa {isa!r} is not usable here; usable: {usable_isas()}")
    previous, _default_isa = _default_isa, isa
    try:
        yield
    finally:
        _default_isa = previous


def current_isa() -> str:
    """What a kernel call naming no `isa` runs: using_isa()'s, or "" (the best usable)."""
    return _default_isa


def integer_dot_isas() -> list[str]:
    """The usable instruction sets whose decode attention scores quantized keys by integer dot
    products, the query quantized to int8 per group (kernels/kv_quant.py: query_round_trip)."""
    return list(_extension().integer_dot_isas())


def stolen_ranges() -> int:
    """Ranges of work that a kernel thread, having run out, took from another since import."""
    return int(_extension().stolen_ranges())


def _check_tensor(name: str, tensor, ndim: int, dtypes) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_cpu:  # not device.type: building the device object cost ~0.9 us a tensor, per call
        raise ValueError(f"{name} must be on the CPU, got {tensor.device}")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(tensor.shape)}")
    if tensor.dtype not in dtypes:
        raise ValueError(f"{name} dtype must be one of {[str(d) for d in dtypes]}, got {tensor.dtype}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_shape(name: str, tensor: torch.Tensor, shape: tuple) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(tensor.shape)}")


def paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens, scale, *, out=None,
                           new_key=None, new_value=None, num_threads=None, whole_sequences=False,
                           isa=None, kv_format: str | None = None, block_size: int | None = None) -> torch.Tensor:
    """Attention of one new token per sequence over its paged KV cache.

    query [batch, num_heads, head_dim] fp32/bf16/fp16; key_cache [num_blocks,
    num_kv_heads, head_dim, block_size] and value_cache [num_blocks, num_kv_heads,
    block_size, head_dim], fp32/bf16/fp16 (head_dim a multiple of 16); block_tables
    int32 [batch, max_blocks_per_seq]; context_lens int32 [batch], counting the new token. With new_key/new_value [batch,
    num_kv_heads, head_dim] (cache dtype) the new token's K/V is first written at
    position context_lens - 1. Returns out [batch, num_heads, head_dim] in the
    query's dtype. num_threads defaults to default_num_threads(); isa forces one
    of usable_isas() (default: the best). Raises ValueError on malformed input.
    The GIL is released while the kernel runs. With more than one thread, a thread
    that runs out takes work from another, so where sequences are cut and merged,
    and with it the last bits of the result, can change from call to call; one
    thread gives the same bits every time, and so does whole_sequences=True at any
    thread count (each sequence attended by one thread, none taking another's work;
    the batch's sequences are the most threads used).

    kv_format "int8", "int4" or "k8v4" (kernels/kv_quant.py) reads group-quantized pools instead: key_cache
    and value_cache uint8 [num_blocks, num_kv_heads, unit_bytes] (each its side's), block_size given (a multiple of
    16), head_dim a multiple of 64; new_key/new_value then come in the query's dtype and are
    quantized into their slots.
    """
    ext = _extension()
    _check_tensor("query", query, 3, _DTYPE_CODES)
    batch, num_heads, head_dim = query.shape
    if kv_format is None:
        num_blocks, num_kv_heads, block_size = _check_dense_caches(key_cache, value_cache, head_dim)
        kv_code, new_kv_dtype = _DTYPE_CODES[key_cache.dtype], key_cache.dtype
    else:
        num_blocks, num_kv_heads = _check_quantized_caches(key_cache, value_cache, kv_format, head_dim, block_size)
        kv_code, new_kv_dtype = kv_quant.FORMAT_CODES[kv_format], query.dtype
    _check_tensor("block_tables", block_tables, 2, (torch.int32,))
    if block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must have {batch} rows (the batch), got {block_tables.shape[0]}")
    _check_tensor("context_lens", context_lens, 1, (torch.int32,))
    _check_shape("context_lens", context_lens, (batch,))
    if out is None:
        out = torch.empty_like(query)
    else:
        _check_tensor("out", out, 3, (query.dtype,))
        _check_shape("out", out, tuple(query.shape))
    if (new_key is None) != (new_value is None):
        raise ValueError("new_key and new_value must be given together")
    if new_key is not None:
        for name, tensor in (("new_key", new_key), ("new_value", new_value)):
            _check_tensor(name, tensor, 3, (new_kv_dtype,))
            _check_shape(name, tensor, (batch, num_kv_heads, head_dim))
    if num_threads is None:
        num_threads = default_num_threads()
    ext.paged_decode_attention(
        query.data_ptr(), out.data_ptr(), _DTYPE_CODES[query.dtype],
        key_cache.data_ptr(), value_cache.data_ptr(), kv_code, num_blocks,
        block_tables.data_ptr(), context_lens.data_ptr(), batch, block_tables.shape[1],
        num_heads, num_kv_heads, head_dim, block_size, float(scale),
        0 if new_key is None else new_key.data_ptr(), 0 if new_value is None else new_value.data_ptr(),
        int(num_threads), bool(whole_sequences), isa or _default_isa,
    )
    return out


def _check_dense_caches(key_cache, value_cache, head_dim: int) -> tuple[int, int, int]:
    """Checks 16-bit or fp32 caches against the query's head_dim -> (num_blocks, num_kv_heads, block_size)."""
    _check_tensor("key_cache", key_cache, 4, _DTYPE_CODES)
    _check_tensor("value_cache", value_cache, 4, (key_cache.dtype,))
    num_blocks, num_kv_heads, block_size, cache_head_dim = value_cache.shape
    _check_shape("key_cache", key_cache, (num_blocks, num_kv_heads, cache_head_dim, block_size))
    if cache_head_dim != head_dim:
        raise ValueError(f"value_cache head_dim {cache_head_dim} does not match query head_dim {head_dim}")
    if block_size < 1:
        raise ValueError("value_cache block_size must be at least 1")
    return num_blocks, num_kv_heads, block_size


def _check_quantized_caches(key_cache, value_cache, kv_format: str, head_dim: int,
                            block_size: int | None) -> tuple[int, int]:
    """Checks kv_format pools [num_blocks, num_kv_heads, unit_bytes] uint8 -> (num_blocks, num_kv_heads)."""
    if block_size is None:
        raise ValueError(f"a {kv_format} KV cache needs block_size: its pools' shape does not hold it")
    layout = kv_quant.layout_for(kv_format, head_dim, block_size)  # ValueError for a bad format or head_dim
    if block_size < 1 or block_size % QUANTIZED_BLOCK_MULTIPLE:
        raise ValueError(f"a {kv_format} KV cache needs block_size a multiple of {QUANTIZED_BLOCK_MULTIPLE}, "
                         f"got {block_size}")
    _check_tensor("key_cache", key_cache, 3, (torch.uint8,))
    _check_tensor("value_cache", value_cache, 3, (torch.uint8,))
    num_blocks, num_kv_heads, _ = key_cache.shape
    for name, pool, side in (("key_cache", key_cache, layout.key), ("value_cache", value_cache, layout.value)):
        if pool.shape[2] != side.unit_bytes:
            raise ValueError(f"a {kv_format} {name.removesuffix('_cache')} unit of head_dim {head_dim} and block_size "
                             f"{block_size} holds {side.unit_bytes} bytes, but {name}'s last dimension is "
                             f"{pool.shape[2]}")
        _check_shape(name, pool, (num_blocks, num_kv_heads, side.unit_bytes))
    return num_blocks, num_kv_heads


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, isa: str | None = None) -> torch.Tensor:
    """weight * to_dtype(x * rsqrt(mean(x^2) + eps)) over rows of x [rows, hidden], fp32 inside,
    in x's dtype (kernels/cpu/rms_norm_impl.h); one call where torch runs four ops. x and weight
    contiguous, same dtype, hidden a multiple of 16. Raises ValueError otherwise."""
    if x.dim() != 2 or weight.shape != (x.shape[1],) or weight.dtype != x.dtype or x.dtype not in _DTYPE_CODES:
        raise ValueError(f"rms_norm takes x [rows, hidden] and weight [hidden] of one dtype, got "
                         f"{tuple(x.shape)} {x.dtype} and {tuple(weight.shape)} {weight.dtype}")
    x = x.contiguous()
    out = torch.empty_like(x)
    _extension().rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), _DTYPE_CODES[x.dtype], x.shape[0],
                          x.shape[1], float(eps), isa or _default_isa)
    return out


def rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         isa: str | None = None) -> torch.Tensor:
    """x [tokens, heads, head_dim] rotated at positions [tokens] (int64) by the fp32 tables
    cos, sin [max_positions, head_dim] (rotate-half), in x's dtype (kernels/cpu/rope_impl.h).
    head_dim a multiple of 32; positions must be inside the tables (not checked: the caller's
    positions come from the scheduler, bounded by max_model_len). Raises ValueError otherwise."""
    if (x.dim() != 3 or x.dtype not in _DTYPE_CODES or positions.dtype != torch.int64
            or positions.shape != (x.shape[0],) or cos.dtype != torch.float32 or cos.shape[1] != x.shape[2]):
        raise ValueError(f"rope takes x [tokens, heads, head_dim], int64 positions [tokens] and fp32 tables "
                         f"[positions, head_dim], got {tuple(x.shape)} {x.dtype}, {tuple(positions.shape)} "
                         f"{positions.dtype}, {tuple(cos.shape)} {cos.dtype}")
    x, positions = x.contiguous(), positions.contiguous()
    out = torch.empty_like(x)
    _extension().rope(x.data_ptr(), out.data_ptr(), _DTYPE_CODES[x.dtype], positions.data_ptr(), cos.data_ptr(),
                      sin.data_ptr(), x.shape[0], x.shape[1], x.shape[2], isa or _default_isa)
    return out


def silu_mul(gate_up: torch.Tensor, isa: str | None = None) -> torch.Tensor:
    """SwiGLU's glue: gate_up [rows, 2 * width] (gate, then up) -> silu(gate) * up [rows, width],
    silu as gate / (1 + e^-gate) rounded to the dtype, then the product rounded, as torch's two
    ops round (kernels/cpu/elementwise_impl.h; e^x by the kernels' own polynomial, within an ulp
    of torch's). width a multiple of 16. Raises ValueError otherwise."""
    if gate_up.dim() != 2 or gate_up.dtype not in _DTYPE_CODES or gate_up.shape[1] % 32:
        raise ValueError(f"silu_mul takes gate_up [rows, 2 * width] with width a multiple of 16, got "
                         f"{tuple(gate_up.shape)} {gate_up.dtype}")
    gate_up = gate_up.contiguous()
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
    _extension().silu_mul(gate_up.data_ptr(), out.data_ptr(), _DTYPE_CODES[gate_up.dtype], gate_up.shape[0],
                          out.shape[1], isa or _default_isa)
    return out


DENSE_LINEAR_MAX_ROWS = 8
DENSE_LINEAR_K_MULTIPLE = 16


def dense_linear(x: torch.Tensor, weight: torch.Tensor, num_threads: int = 1, isa: str | None = None) -> torch.Tensor:
    """y = x @ weight^T for 1-4 rows of x [rows, k] (any float dtype, read as fp32) and a dense
    weight [n, k] in fp32/bf16/fp16 (kernels/cpu/gemv_impl.h), y fp32 [rows, n]: the weight read
    once at memory speed. k a multiple of 16. Raises ValueError otherwise."""
    _check_tensor("weight", weight, 2, _DTYPE_CODES)
    if x.dim() != 2 or not 1 <= x.shape[0] <= DENSE_LINEAR_MAX_ROWS or x.shape[1] != weight.shape[1]:
        raise ValueError(f"dense_linear takes x [1-{DENSE_LINEAR_MAX_ROWS}, k] and weight [n, k], got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    x32 = x.float().contiguous()
    y = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    _extension().dense_linear(x32.data_ptr(), weight.data_ptr(), _DTYPE_CODES[weight.dtype], y.data_ptr(),
                              x.shape[0], weight.shape[0], x.shape[1], int(num_threads), isa or _default_isa)
    return y


def _thread_candidates(num_cores: int) -> list[int]:
    """1, 2, 4, ... up to num_cores, and num_cores itself."""
    candidates = {num_cores}
    count = 1
    while count < num_cores:
        candidates.add(count)
        count *= 2
    return sorted(candidates)


def calibrate_num_threads(run: Callable[[int], object]) -> int:
    """The thread count with which `run(num_threads)` (a memory-bound calibration call) was fastest,
    over 1, 2, 4, ... the cores this process may run on. A count wins only if it beats every
    smaller count by _CALIBRATION_MARGIN, since extra threads cost wake-ups and steal cores from
    whatever runs beside the kernel (LM-Offload sec. 4: the default count can cost 40%)."""
    num_cores = len(os.sched_getaffinity(0))
    if num_cores == 1 or not is_available():
        return 1
    best_threads, best_time = 1, float("inf")
    for threads in _thread_candidates(num_cores):
        times = []
        for _ in range(_CALIBRATION_REPS + 1):  # the first call warms the pool and caches
            start = time.perf_counter()
            run(threads)
            times.append(time.perf_counter() - start)
        elapsed = min(times[1:])
        if elapsed < best_time * (1 - _CALIBRATION_MARGIN):
            best_threads, best_time = threads, elapsed
    return best_threads


@functools.cache
def default_num_threads() -> int:
    """The decode attention's thread count: calibrated once per process (about a tenth of a
    second) on a Llama-3-8B layer's attention over 64 MiB of bf16 KV."""
    if not is_available():
        return 1
    blocks_per_seq = _CALIBRATION_CONTEXT // _CALIBRATION_BLOCK
    num_blocks = _CALIBRATION_BATCH * blocks_per_seq
    shape = (num_blocks, _CALIBRATION_KV_HEADS, _CALIBRATION_BLOCK, _CALIBRATION_HEAD_DIM)
    key_cache = torch.randn(shape, dtype=torch.bfloat16).transpose(-1, -2).contiguous()
    value_cache = torch.randn(shape, dtype=torch.bfloat16)
    query = torch.randn(_CALIBRATION_BATCH, _CALIBRATION_KV_HEADS * _CALIBRATION_GROUP, _CALIBRATION_HEAD_DIM)
    block_tables = torch.randperm(num_blocks, dtype=torch.int32).view(_CALIBRATION_BATCH, blocks_per_seq)
    context_lens = torch.full((_CALIBRATION_BATCH,), _CALIBRATION_CONTEXT, dtype=torch.int32)
    out = torch.empty_like(query)
    return calibrate_num_threads(lambda threads: paged_decode_attention(
        query, key_cache, value_cache, block_tables, context_lens, 1.0, out=out, num_threads=threads))
