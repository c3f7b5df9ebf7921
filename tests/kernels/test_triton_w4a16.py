"""The Triton W4A16 kernels (kernels/triton/w4a16.py) against a plain torch reference on fresh
random inputs, run on CPU tensors by Triton's interpreter (the `interpreted_w4a16` fixture of
tests/conftest.py): the in-register kernel, the dequantize-then-matmul path, the switch between
them, and the errors malformed input gets.

The interpreter runs every program instance in Python, so the shapes are small: SmolLM2-135M's
matmuls, odd ones (n odd, k not a multiple of 256) and one 4096x4096 at batch 2. Llama-3.1-8B's
MLP shapes (3.5x that: ~30 s each here) are left to benchmarks/triton_w4a16.py on a GPU.
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


@pytest.fixture
def w4a16(interpreted_w4a16):
    return interpreted_w4a16


def random_weight(n, k, group_size, gen):
    """(qweight, scales, mins) from random codes over all 16 levels, and the fp64 [n, k] matrix
    they stand for, computed here from the codes, not by the kernels' layout code."""
    levels = torch.randint(0, int4.MAX_LEVEL + 1, (n, k), generator=gen, dtype=torch.uint8)
    scales = torch.rand(n, k // group_size, generator=gen) * 0.1
    mins = -torch.rand(n, k // group_size, generator=gen) * 0.8
    groups = levels.double().reshape(n, k // group_size, group_size)
    dense = (groups * scales.double()[..., None] + mins.double()[..., None]).reshape(n, k)
    return int4.pack(levels), scales, mins, dense


def relative_error(actual, expected):
    return float((actual.double() - expected).abs().max() / expected.abs().max())


def tolerance(dtype):
    """fp32: RELATIVE_TOLERANCE. Half inputs also round y to their dtype, which the interpreter
    does by truncating (a GPU rounds to nearest): up to one unit in the last place of bf16."""
    return max(RELATIVE_TOLERANCE, torch.finfo(dtype).eps)


def test_the_kernels_run_interpreted(w4a16):
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(w4a16._packed_linear_kernel, InterpretedFunction)
    assert isinstance(w4a16._dequantize_kernel, InterpretedFunction)


@pytest.mark.parametrize("n, k, group_size", SMOLLM2_PROBLEMS)
def test_packed_kernel_on_smollm2_shapes(w4a16, gen, n, k, group_size):
    qweight, scales, mins, dense = random_weight(n, k, group_size, gen)
    x = torch.randn(3, k, generator=gen)
    y = w4a16.packed_linear(x, qweight, scales, mins, group_size)
    assert y.shape == (3, n) and y.dtype == torch.float32
    assert relative_error(y, x.double() @ dense.T) <= RELATIVE_TOLERANCE


@pytest.mark.parametrize("n, k, group_size", ODD_PROBLEMS)
@pytest.mark.parametrize("batch", BATCHES)
def test_both_paths_on_odd_shapes(w4a16, gen, n, k, group_size, batch):
    """The packed kernel at every batch (one row tile and more), and dequantize + matmul."""
    qweight, scales, mins, dense = random_weight(n, k, group_size, gen)
    x = torch.randn(batch, k, generator=gen)
    expected = x.double() @ dense.T
    assert relative_error(w4a16.packed_linear(x, qweight, scales, mins, group_size), expected) <= RELATIVE_TOLERANCE
    dequantized = w4a16.dequantize_into(qweight, scales, mins, group_size, torch.empty(n, k))
    assert relative_error(dequantized, dense) <= RELATIVE_TOLERANCE
    assert relative_error(x @ dequantized.T, expected) <= RELATIVE_TOLERANCE


@pytest.mark.parametrize("batch", BATCHES)
def test_linear_switches_to_the_dense_buffer_above_the_threshold(w4a16, gen, batch):
    """Up to MAX_PACKED_ROWS the caller's dense buffer stays untouched; above, W lands in it."""
    n, k, group_size = 1536, 576, 32
    qweight, scales, mins, dense = random_weight(n, k, group_size, gen)
    x = torch.randn(batch, k, generator=gen)
    buffer = torch.full((n, k), float("nan"))
    out = torch.empty(batch, n)
    y = w4a16.w4a16_linear(x, qweight, scales, mins, group_size, out=out, dense=buffer)
    assert y.data_ptr() == out.data_ptr()
    assert relative_error(y, x.double() @ dense.T) <= RELATIVE_TOLERANCE
    if batch <= w4a16.MAX_PACKED_ROWS:
        assert buffer.isnan().all()
    else:
        assert relative_error(buffer, dense) <= RELATIVE_TOLERANCE


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", [3, 33])
def test_half_precision_inputs(w4a16, gen, dtype, batch):
    """Loaded as they are and widened to fp32 in the kernel (the interpreter has no bf16
    arithmetic); y and the dense buffer come out in x's dtype."""
    n, k, group_size = 67, 192, 64
    qweight, scales, mins, dense = random_weight(n, k, group_size, gen)
    x = torch.randn(batch, k, generator=gen).to(dtype)
    y = w4a16.w4a16_linear(x, qweight, scales, mins, group_size)
    assert y.dtype == dtype
    assert relative_error(y, x.double() @ dense.T) <= tolerance(dtype)
    dequantized = w4a16.dequantize_into(qweight, scales, mins, group_size, torch.empty(n, k, dtype=dtype))
    assert relative_error(dequantized, dense) <= tolerance(dtype)


def test_llama_8b_attention_shape(w4a16, gen):
    """4096x4096 (Llama-3.1-8B's O-projection), the decode case: 32 steps of the loop over k
    in each of 64 column tiles; ~8 s in the interpreter."""
    n, k, group_size = 4096, 4096, 32
    qweight, scales, mins, dense = random_weight(n, k, group_size, gen)
    x = torch.randn(2, k, generator=gen)
    assert relative_error(w4a16.packed_linear(x, qweight, scales, mins, group_size), x.double() @ dense.T) \
        <= RELATIVE_TOLERANCE


def test_non_contiguous_x(w4a16, gen):
    """x is read through its strides: a column slice works without a copy."""
    qweight, scales, mins, dense = random_weight(67, 96, 32, gen)
    x = torch.randn(4, 200, generator=gen)[:, 10:106]
    assert relative_error(w4a16.w4a16_linear(x, qweight, scales, mins, 32), x.double() @ dense.T) \
        <= RELATIVE_TOLERANCE


def test_empty_batch(w4a16, gen):
    qweight, scales, mins, _ = random_weight(67, 96, 32, gen)
    assert w4a16.w4a16_linear(torch.empty(0, 96), qweight, scales, mins, 32).shape == (0, 67)


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
    ("scales", torch.ones(64, 4, dtype=torch.float16), "scales dtype"),
    ("mins", torch.ones(64, 4, device="meta"), "mins must be on cpu"),
    ("group_size", 48, "group_size must be one of"),
    ("group_size", 256, "group_size must be one of"),
])
@pytest.mark.parametrize("batch", [3, 33])
def test_malformed_input_raises_a_value_error_naming_it(w4a16, field, value, message, batch):
    problem = _problem()
    problem["x"] = problem["x"][:1].expand(batch, -1).contiguous()
    problem[field] = value
    with pytest.raises(ValueError, match=message):
        w4a16.w4a16_linear(problem.pop("x"), **problem)


@pytest.mark.parametrize("batch", [3, 33])
def test_malformed_buffers_raise_a_value_error_naming_them(w4a16, batch):
    problem = _problem()
    problem["x"] = torch.randn(batch, 128)
    for buffers, message in [
        ({"out": torch.empty(batch, 65)}, rf"out must have shape \({batch}, 64\)"),
        ({"out": torch.empty(batch, 64, dtype=torch.float16)}, "out dtype"),
        ({"dense": torch.empty(64, 128, dtype=torch.bfloat16)}, "dense dtype"),
        ({"dense": torch.empty(128, 64)}, r"dense must have shape \(64, 128\)"),
    ]:
        with pytest.raises(ValueError, match=message):
            w4a16.w4a16_linear(**problem, **buffers)


def test_dequantize_into_checks_its_buffer(w4a16):
    problem = _problem()
    del problem["x"]
    with pytest.raises(ValueError, match=r"out must have shape \(64, 128\)"):
        w4a16.dequantize_into(**problem, out=torch.empty(64, 64))
    with pytest.raises(ValueError, match="out dtype"):
        w4a16.dequantize_into(**problem, out=torch.empty(64, 128, dtype=torch.float64))
