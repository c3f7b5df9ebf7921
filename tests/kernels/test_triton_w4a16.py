"""The Triton W4A16 kernels (kernels/triton/w4a16.py) against a plain torch reference on fresh
random inputs, run on CPU tensors by Triton's interpreter and, where a GPU is, compiled on CUDA
tensors (the `triton_w4a16` fixture of tests/conftest.py): the in-register kernel, the
dequantize-then-matmul path, the switch between them, and the errors malformed input gets.

The interpreter runs every program instance in Python, so the shapes are small: SmolLM2-135M's
matmuls, odd ones (n odd, k not a multiple of 256) at every row count from 1 to 16 and beyond, and
one 4096x4096 at batch 2 (slow). Llama-3.1-8B's MLP shapes (3.5x that: ~30 s each here) are left to
benchmarks/kernels/triton_w4a16.py on a GPU. Without a GPU every schedule the packed kernel may
time is still compiled for an H100 (sm_90), so a GPU's minutes never go to a compile error.
"""

import pytest
import torch

from kernels.cpu import int4

RELATIVE_TOLERANCE = 1e-3
# (n, k, group_size): SmolLM2-135M's matmuls at every group size that divides k, and odd ones
# (n odd, k not a multiple of 256; 96, 160 and 192 end in a part of the interpreter's 128-weight tile)
SMOLLM2_PROBLEMS = [(n, k, group_size) for n, k in [(576, 576), (1536, 576), (576, 1536)]
                    for group_size in int4.GROUP_SIZES if k % group_size == 0]
ODD_PROBLEMS = [(67, 96, 32), (67, 160, 32), (33, 192, 64), (33, 640, 128)]
BATCHES = [1, 3, 16, 17, 33]
DECODE_ROWS = list(range(1, 17))  # every row count the packed kernel is for


def random_weight(n, k, group_size, gen, param_dtype=torch.float32):
    """(qweight, scales, mins) from random codes over all 16 levels, scales and mins in
    `param_dtype` (fp16 as GGUF Q4_0/Q4_1 store them), and the fp64 [n, k] matrix they stand for,
    computed here from the codes, not by the kernels' layout code."""
    levels = torch.randint(0, int4.MAX_LEVEL + 1, (n, k), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n, k // group_size, generator=gen) * 0.1).to(param_dtype)
    mins = (-torch.rand(n, k // group_size, generator=gen) * 0.8).to(param_dtype)
    groups = levels.double().reshape(n, k // group_size, group_size)
    dense = (groups * scales.double()[..., None] + mins.double()[..., None]).reshape(n, k)
    return int4.pack(levels), scales, mins, dense


def on(device, *tensors):
    """The test's inputs, made on the CPU, where its kernels run (the same tensors for cpu)."""
    return tuple(tensor.to(device) for tensor in tensors)


def relative_error(actual, expected):
    """Max |actual - expected| over max |expected|: actual from any device, expected (fp64) on the CPU."""
    return float((actual.cpu().double() - expected).abs().max() / expected.abs().max())


def tolerance(dtype, device):
    """fp32: RELATIVE_TOLERANCE. Half inputs also round y to their dtype, which the interpreter
    does by truncating (a GPU rounds to nearest): up to one unit in the last place of bf16. On
    CUDA the kernels compute in the dtype as well: the unpacked weights are rounded to it for the
    tensor cores (eps / 2 of each product; the dense path's buffer likewise, then cuBLAS): 2 eps."""
    eps = torch.finfo(dtype).eps
    return max(RELATIVE_TOLERANCE, eps if device == "cpu" else 2 * eps)


def test_the_kernels_run_interpreted(interpreted_w4a16):
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(interpreted_w4a16._packed_linear_kernel, InterpretedFunction)
    assert isinstance(interpreted_w4a16._dequantize_kernel, InterpretedFunction)


@pytest.mark.parametrize("group_size", int4.GROUP_SIZES)
@pytest.mark.parametrize("rows", DECODE_ROWS)
def test_packed_kernel_at_every_decode_row_count_with_fp16_scales(triton_w4a16, gen, group_size, rows):
    """1-16 rows (one row: the elementwise path; more: tl.dot), k split into runs whose partial
    sums the second kernel adds, a ragged n and a k that ends mid-tile; scales and mins in fp16."""
    w4a16, device = triton_w4a16
    n, k = 67, 640
    qweight, scales, mins, dense = random_weight(n, k, group_size, gen, torch.float16)
    x = torch.randn(rows, k, generator=gen)
    on_device = on(device, x, qweight, scales, mins)
    y = w4a16.packed_linear(*on_device, group_size)
    assert relative_error(y, x.double() @ dense.T) <= RELATIVE_TOLERANCE
    if device == "cpu":  # the interpreter's fixed schedule splits this k: the reduction ran
        assert w4a16.schedule_for(*on_device, group_size).split_k > 1


@pytest.mark.parametrize("split_k", [1, 2, 5])
@pytest.mark.parametrize("rows", [1, 4])
def test_every_split_of_k_gives_the_same_product(interpreted_w4a16, gen, split_k, rows):
    """A schedule given outright: runs of k tiles, one of them shorter than the others at 2."""
    w4a16 = interpreted_w4a16
    n, k, group_size = 33, 640, 64
    qweight, scales, mins, dense = random_weight(n, k, group_size, gen, torch.float16)
    x = torch.randn(rows, k, generator=gen)
    schedule = w4a16.PackedSchedule(block_n=16, block_k=128, split_k=split_k)
    y = w4a16.packed_linear(x, qweight, scales, mins, group_size, schedule=schedule)
    assert relative_error(y, x.double() @ dense.T) <= RELATIVE_TOLERANCE


def test_the_split_over_k_fills_an_h100_at_batch_1(interpreted_w4a16):
    """4096x4096 at one row: every candidate gives each of 132 SMs a program, some several, and
    no run of k is empty."""
    w4a16 = interpreted_w4a16
    num_sms, programs = 132, []
    for schedule in w4a16.candidates(4096, 4096, 1, num_sms=num_sms):
        programs.append(-(-4096 // schedule.block_n) * schedule.split_k)
        num_k_tiles = -(-4096 // schedule.block_k)
        assert (schedule.split_k - 1) * -(-num_k_tiles // schedule.split_k) < num_k_tiles
    assert min(programs) >= num_sms and max(programs) >= 4 * num_sms


def compile_for_h100(kernel, signature: dict, constexprs: dict, num_warps: int, num_stages: int):
    """`kernel` compiled ahead of time for sm_90 (no GPU needed: Triton's own ptxas)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})


def packed_kernel_signature(param_dtype: str) -> dict:
    return {"x_ptr": "*bf16", "qweight_ptr": "*u8", "scales_ptr": f"*{param_dtype}", "mins_ptr": f"*{param_dtype}",
            "y_ptr": "*bf16", "partial_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "K_PER_RUN": "i32",
            "stride_xm": "i32", "stride_xk": "i32"}


def compile_candidates(w4a16, tiles, block_m: int, group_size: int, param_dtype: str) -> None:
    import triton.language as tl

    for block_n, block_k, num_warps, num_stages in tiles:
        compiled = compile_for_h100(
            w4a16._packed_linear_kernel, packed_kernel_signature(param_dtype),
            {"GROUP_SIZE": group_size, "DOT_DTYPE": tl.bfloat16, "BLOCK_M": block_m, "BLOCK_N": block_n,
             "BLOCK_K": block_k, "SPLIT_K": 4}, num_warps, num_stages)
        assert "evict_first" in compiled.asm["ptx"]  # the weights' loads carry the hint


def test_the_packed_kernel_compiles_for_an_h100(compiled_w4a16):
    """One tile of each path, bf16 x, fp16 scales; the sum of the splits too."""
    w4a16 = compiled_w4a16
    compile_candidates(w4a16, w4a16._ROW_TILES[:1], 1, 32, "fp16")
    compile_candidates(w4a16, w4a16._DOT_TILES[:1], w4a16.DOT_ROWS, 128, "fp16")
    compile_for_h100(w4a16._sum_splits_kernel, {"partial_ptr": "*fp32", "y_ptr": "*bf16", "NUM_OUTPUTS": "i32"},
                     {"SPLIT_K": 4, "BLOCK": w4a16.SUM_BLOCK}, 4, 1)


@pytest.mark.slow
@pytest.mark.parametrize("group_size", int4.GROUP_SIZES)
@pytest.mark.parametrize("param_dtype", ["fp16", "fp32"])
def test_every_candidate_schedule_compiles_for_an_h100(group_size, param_dtype, compiled_w4a16):
    w4a16 = compiled_w4a16
    compile_candidates(w4a16, w4a16._ROW_TILES, 1, group_size, param_dtype)
    compile_candidates(w4a16, w4a16._DOT_TILES, w4a16.DOT_ROWS, group_size, param_dtype)


@pytest.mark.parametrize("n, k, group_size", SMOLLM2_PROBLEMS)
def test_packed_kernel_on_smollm2_shapes(triton_w4a16, gen, n, k, group_size):
    w4a16, device = triton_w4a16
    qweight, scales, mins, dense = random_weight(n, k, group_size, gen)
    x = torch.randn(3, k, generator=gen)
    y = w4a16.packed_linear(*on(device, x, qweight, scales, mins), group_size)
    assert y.shape == (3, n) and y.dtype == torch.float32 and y.device.type == device
    assert relative_error(y, x.double() @ dense.T) <= RELATIVE_TOLERANCE


@pytest.mark.parametrize("n, k, group_size", ODD_PROBLEMS)
@pytest.mark.parametrize("batch", BATCHES)
def test_both_paths_on_odd_shapes(triton_w4a16, gen, n, k, group_size, batch):
    """The packed kernel at every batch (one row tile and more), and dequantize + matmul."""
    w4a16, device = triton_w4a16
    qweight, scales, mins, dense = random_weight(n, k, group_size, gen)
    x = torch.randn(batch, k, generator=gen)
    expected = x.double() @ dense.T
    x, qweight, scales, mins = on(device, x, qweight, scales, mins)
    assert relative_error(w4a16.packed_linear(x, qweight, scales, mins, group_size), expected) <= RELATIVE_TOLERANCE
    dequantized = w4a16.dequantize_into(qweight, scales, mins, group_size, torch.empty(n, k, device=device))
    assert relative_error(dequantized, dense) <= RELATIVE_TOLERANCE
    assert relative_error(x @ dequantized.T, expected) <= RELATIVE_TOLERANCE


@pytest.mark.parametrize("batch", BATCHES)
def test_linear_switches_to_the_dense_buffer_above_the_threshold(triton_w4a16, gen, batch):
    """Up to MAX_PACKED_ROWS the caller's dense buffer stays untouched; above, W lands in it."""
    w4a16, device = triton_w4a16
    n, k, group_size = 1536, 576, 32
    qweight, scales, mins, dense = random_weight(n, k, group_size, gen)
    x = torch.randn(batch, k, generator=gen)
    buffer = torch.full((n, k), float("nan"), device=device)
    out = torch.empty(batch, n, device=device)
    y = w4a16.w4a16_linear(*on(device, x, qweight, scales, mins), group_size, out=out, dense=buffer)
    assert y.data_ptr() == out.data_ptr()
    assert relative_error(y, x.double() @ dense.T) <= RELATIVE_TOLERANCE
    if batch <= w4a16.MAX_PACKED_ROWS:
        assert buffer.isnan().all()
    else:
        assert relative_error(buffer, dense) <= RELATIVE_TOLERANCE


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", [3, 33])
def test_half_precision_inputs(triton_w4a16, gen, dtype, batch):
    """Loaded as they are and widened to fp32 in the kernel under the interpreter (it has no
    bf16 arithmetic), multiplied in the dtype on CUDA; y and the dense buffer come out in x's dtype."""
    w4a16, device = triton_w4a16
    n, k, group_size = 67, 192, 64
    qweight, scales, mins, dense = random_weight(n, k, group_size, gen)
    x = torch.randn(batch, k, generator=gen).to(dtype)
    qweight, scales, mins = on(device, qweight, scales, mins)
    y = w4a16.w4a16_linear(x.to(device), qweight, scales, mins, group_size)
    assert y.dtype == dtype
    assert relative_error(y, x.double() @ dense.T) <= tolerance(dtype, device)
    dequantized = w4a16.dequantize_into(qweight, scales, mins, group_size,
                                        torch.empty(n, k, dtype=dtype, device=device))
    assert relative_error(dequantized, dense) <= tolerance(dtype, device)


@pytest.mark.slow
def test_llama_8b_attention_shape(triton_w4a16, gen):
    """4096x4096 (Llama-3.1-8B's O-projection), the decode case: 32 steps of the loop over k
    in each of 64 column tiles; ~8 s in the interpreter."""
    w4a16, device = triton_w4a16
    n, k, group_size = 4096, 4096, 32
    qweight, scales, mins, dense = random_weight(n, k, group_size, gen)
    x = torch.randn(2, k, generator=gen)
    y = w4a16.packed_linear(*on(device, x, qweight, scales, mins), group_size)
    assert relative_error(y, x.double() @ dense.T) <= RELATIVE_TOLERANCE


def test_non_contiguous_x(triton_w4a16, gen):
    """x is read through its strides: a column slice works without a copy."""
    w4a16, device = triton_w4a16
    qweight, scales, mins, dense = random_weight(67, 96, 32, gen)
    whole = torch.randn(4, 200, generator=gen)
    x = whole.to(device)[:, 10:106]  # sliced where it lies: a copy to the device would be contiguous
    assert not x.is_contiguous()
    assert relative_error(w4a16.w4a16_linear(x, *on(device, qweight, scales, mins), 32),
                          whole[:, 10:106].double() @ dense.T) <= RELATIVE_TOLERANCE


def test_empty_batch(triton_w4a16, gen):
    w4a16, device = triton_w4a16
    qweight, scales, mins, _ = random_weight(67, 96, 32, gen)
    x = torch.empty(0, 96, device=device)
    assert w4a16.w4a16_linear(x, *on(device, qweight, scales, mins), 32).shape == (0, 67)


def _problem():
    """A well-formed problem to spoil one field of: n 64, k 128, group size 32."""
    gen = torch.Generator().manual_seed(0)
    qweight, scales, mins, _ = random_weight(64, 128, 32, gen)
    return {"x": torch.randn(3, 128, generator=gen), "qweight": qweight, "scales": scales, "mins": mins,
            "group_size": 32}


@pytest.mark.parametrize("field, value, message", [
    ("x", torch.randn(128), "x must have 2 dimensions"),
    ("x", torch.ones(3, 128, dtype=torch.int32), "x dtype"),
    ("x", torch.randn(3, 96), "x has 96 columns but qweight packs 128"),
    ("x", [[0.0] * 128], "x must be a torch.Tensor"),
    ("qweight", torch.zeros(64, 64, dtype=torch.int8), "qweight dtype"),
    ("qweight", torch.zeros(64, 128, dtype=torch.uint8)[:, ::2], "qweight must be contiguous"),
    ("scales", torch.ones(64, 3), r"scales must have shape \(64, 4\)"),
    ("scales", torch.ones(64, 4, dtype=torch.bfloat16), "scales dtype"),
    ("mins", torch.ones(64, 4, device="meta"), "mins must be on cpu"),
    ("group_size", 48, "group_size must be one of"),
    ("group_size", 256, "group_size must be one of"),
])
@pytest.mark.parametrize("batch", [3, 33])
def test_malformed_input_raises_a_value_error_naming_it(interpreted_w4a16, field, value, message, batch):
    problem = _problem()
    problem["x"] = problem["x"][:1].expand(batch, -1).contiguous()
    problem[field] = value
    with pytest.raises(ValueError, match=message):
        interpreted_w4a16.w4a16_linear(problem.pop("x"), **problem)


@pytest.mark.parametrize("batch", [3, 33])
def test_malformed_buffers_raise_a_value_error_naming_them(interpreted_w4a16, batch):
    problem = _problem()
    problem["x"] = torch.randn(batch, 128)
    for buffers, message in [
        ({"out": torch.empty(batch, 65)}, rf"out must have shape \({batch}, 64\)"),
        ({"out": torch.empty(batch, 64, dtype=torch.float16)}, "out dtype"),
        ({"dense": torch.empty(64, 128, dtype=torch.bfloat16)}, "dense dtype"),
        ({"dense": torch.empty(128, 64)}, r"dense must have shape \(64, 128\)"),
    ]:
        with pytest.raises(ValueError, match=message):
            interpreted_w4a16.w4a16_linear(**problem, **buffers)


def test_dequantize_into_checks_its_buffer(interpreted_w4a16):
    problem = _problem()
    del problem["x"]
    with pytest.raises(ValueError, match=r"out must have shape \(64, 128\)"):
        interpreted_w4a16.dequantize_into(**problem, out=torch.empty(64, 64))
    with pytest.raises(ValueError, match="out dtype"):
        interpreted_w4a16.dequantize_into(**problem, out=torch.empty(64, 128, dtype=torch.float64))
