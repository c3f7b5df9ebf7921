"""The INT4 matmul against a plain torch reference on fresh random inputs, on every instruction
set this machine runs; packing and round-to-nearest quantization."""
import pytest
import torch

from kernels import cpu
from kernels.cpu import int4

pytestmark = pytest.mark.skipif(not cpu.is_available(), reason="the CPU kernels are not built")
ISAS = cpu.usable_isas() if cpu.is_available() else []
# SmolLM2-135M's matmuls, odd ones (n odd, k not a multiple of 256), and Llama-3.1-8B's
SHAPES = [(576, 576), (1536, 576), (576, 1536), (33, 96), (577, 320)]
LLAMA_8B_SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]
RELATIVE_TOLERANCE = 1e-3


def reference(x, qweight, scales, mins, group_size):
    """fp64 x @ W^T over the dequantized weight."""
    return x.double() @ int4.dequantize(qweight, scales, mins, group_size).double().T


def relative_error(actual, expected):
    return float((actual.double() - expected).abs().max() / expected.abs().max())


def random_problem(n, k, group_size, batch, seed):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen)
    x = torch.randn(batch, k, generator=gen)
    return x, *int4.quantize_rtn(weight, group_size)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("group_size", int4.GROUP_SIZES)
def test_matches_the_reference(isa, n, k, group_size):
    if k % group_size:
        pytest.skip(f"k={k} is not a multiple of {group_size}")
    for batch in (1, 2, 3, 4, 5, 9, 16):
        x, qweight, scales, mins = random_problem(n, k, group_size, batch, seed=n * 7 + k + batch)
        for threads in (1, 3):
            y = int4.int4_linear(x, qweight, scales, mins, group_size, num_threads=threads, isa=isa)
            assert y.shape == (batch, n) and y.dtype == torch.float32
            assert relative_error(y, reference(x, qweight, scales, mins, group_size)) <= RELATIVE_TOLERANCE


@pytest.mark.parametrize("n, k", LLAMA_8B_SHAPES)
def test_llama_8b_shapes(n, k):
    x, qweight, scales, mins = random_problem(n, k, 32, 4, seed=n + k)
    expected = reference(x, qweight, scales, mins, 32)
    for isa in ISAS:
        y = int4.int4_linear(x, qweight, scales, mins, 32, num_threads=2, isa=isa)
        assert relative_error(y, expected) <= RELATIVE_TOLERANCE


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_input_returns_its_dtype(dtype):
    x, qweight, scales, mins = random_problem(64, 128, 32, 3, seed=1)
    y = int4.int4_linear(x.to(dtype), qweight, scales, mins, 32)
    assert y.dtype == dtype
    expected = reference(x.to(dtype).float(), qweight, scales, mins, 32)
    assert relative_error(y.float(), expected) <= 1e-2  # the output's own rounding


def test_pack_and_unpack_are_inverse_and_follow_gguf_block_order():
    gen = torch.Generator().manual_seed(0)
    levels = torch.randint(0, 16, (5, 64), generator=gen, dtype=torch.uint8)
    packed = int4.pack(levels)
    assert packed.shape == (5, 32) and torch.equal(int4.unpack(packed), levels)
    # byte i of a block: weight i in the low nibble, weight i + 16 in the high one
    assert int(packed[0, 3]) == int(levels[0, 3]) | (int(levels[0, 19]) << 4)
    assert int(packed[0, 16 + 3]) == int(levels[0, 32 + 3]) | (int(levels[0, 32 + 19]) << 4)


@pytest.mark.parametrize("group_size", int4.GROUP_SIZES)
def test_round_to_nearest_keeps_each_group_within_half_a_step(group_size):
    gen = torch.Generator().manual_seed(group_size)
    weight = torch.randn(16, 256, generator=gen) * torch.rand(16, 1, generator=gen)
    weight[0, :group_size] = 0.25  # a constant group: scale 0, exact
    qweight, scales, mins = int4.quantize_rtn(weight, group_size)
    restored = int4.dequantize(qweight, scales, mins, group_size)
    step = scales.repeat_interleave(group_size, dim=1)
    assert torch.all((restored - weight).abs() <= step / 2 + 1e-6)
    assert torch.equal(restored[0, :group_size], weight[0, :group_size])
    groups = weight.view(16, -1, group_size)
    torch.testing.assert_close(mins, groups.amin(-1))  # each group's smallest weight is exact


@pytest.mark.parametrize("bad, message", [
    (dict(group_size=48), "group_size"),
    (dict(k=100), "multiple of group_size"),
    (dict(qweight_dtype=torch.int8), "qweight dtype"),
    (dict(scales_shape=(8, 3)), "scales must have shape"),
    (dict(num_threads=0), "num_threads"),
])
def test_malformed_input_is_refused(bad, message):
    k = bad.get("k", 64)
    group_size = bad.get("group_size", 32)
    x = torch.randn(2, k)
    qweight = torch.zeros(8, k // 2, dtype=bad.get("qweight_dtype", torch.uint8))
    scales = torch.ones(bad.get("scales_shape", (8, max(1, k // 32))))
    mins = torch.zeros(8, max(1, k // 32))
    with pytest.raises(ValueError, match=message):
        int4.int4_linear(x, qweight, scales, mins, group_size, num_threads=bad.get("num_threads", 1))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_into_writes_the_weight_in_the_asked_dtype(isa, dtype):
    gen = torch.Generator().manual_seed(3)
    qweight, scales, mins = int4.quantize_rtn(torch.randn(70, 192, generator=gen), 64)
    expected = int4.dequantize(qweight, scales, mins, 64)
    out = torch.full((40, 192), float("nan"), dtype=dtype)
    int4.dequantize_into(qweight[20:60], scales[20:60], mins[20:60], 64, out, num_threads=3, isa=isa)
    # one fused multiply-add against torch's multiply then add: the last bit may differ
    torch.testing.assert_close(out.float(), expected[20:60], atol=2e-6, rtol=torch.finfo(dtype).eps)
