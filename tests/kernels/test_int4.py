"""The INT4 matmul against plain torch references on fresh random inputs, on every instruction
set this machine runs; the tiled layout, packing and round-to-nearest quantization.

The kernel quantizes x per block of 32 to int8 (the default) or int16 (kernels/cpu/int4.h), so it
is checked twice: to 1e-5 against the same arithmetic in fp64 (`int4.reference_linear`: the kernel
itself), and to int4.ACTIVATION_RELATIVE_ERROR against the fp32 product on the dequantized weight
(what quantizing the activations costs). The NEON paths run under qemu-user in
test_int4_isa_check.py."""
import os
import subprocess
import sys

import pytest
import torch

from kernels import cpu
from kernels.cpu import int4

pytestmark = pytest.mark.skipif(not cpu.is_available(), reason="the CPU kernels are not built")
ISAS = cpu.usable_isas() if cpu.is_available() else []
# SmolLM2-135M's matmuls, odd ones (n odd, k not a multiple of 256), and Llama-3.1-8B's
SHAPES = [(576, 576), (1536, 576), (576, 1536), (33, 96), (577, 320)]
LLAMA_8B_SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]
# decode batches, and prefill's: ragged against every register block (4, 8 rows) and panel
BATCHES = (1, 2, 3, 4, 5, 9, 16, 17, 64, 65, 300)
KERNEL_TOLERANCE = 1e-5


def reference(x, qweight, scales, mins, group_size):
    """fp64 x @ W^T over the dequantized weight."""
    return x.double() @ int4.dequantize(qweight, scales, mins, group_size).double().T


def relative_error(actual, expected):
    return float((actual.double() - expected).abs().max() / expected.abs().max())


def random_problem(n, k, group_size, batch):
    weight = torch.randn(n, k)
    x = torch.randn(batch, k)
    return x, *int4.quantize_rtn(weight, group_size)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("group_size", int4.GROUP_SIZES)
@pytest.mark.parametrize("activation_bits", int4.ACTIVATION_BITS)
def test_matches_the_reference(isa, n, k, group_size, activation_bits):
    if k % group_size:
        pytest.skip(f"k={k} is not a multiple of {group_size}")
    batches = BATCHES if activation_bits == 8 else BATCHES[:-2]  # int16: decode's kernel
    for batch in batches:
        x, qweight, scales, mins = random_problem(n, k, group_size, batch)
        weight = int4.TiledInt4.from_packed(qweight, scales, mins, group_size)
        expected = int4.reference_linear(x, qweight, scales, mins, group_size, activation_bits)
        for threads in (1, 3):
            y = int4.int4_linear(x, weight, num_threads=threads, isa=isa, activation_bits=activation_bits)
            assert y.shape == (batch, n) and y.dtype == torch.float32
            assert relative_error(y, expected) <= KERNEL_TOLERANCE
            assert (relative_error(y, reference(x, qweight, scales, mins, group_size))
                    <= int4.ACTIVATION_RELATIVE_ERROR[activation_bits])


@pytest.mark.parametrize("isa", ISAS)
def test_a_rows_result_does_not_depend_on_its_neighbours(isa):
    # per-row quantization and integer sums: the same bits alone, in any batch, on any threads
    x, qweight, scales, mins = random_problem(577, 320, 64, 70)
    weight = int4.TiledInt4.from_packed(qweight, scales, mins, 64)
    together = int4.int4_linear(x, weight, num_threads=3, isa=isa)
    for row in (0, 8, 69):
        alone = int4.int4_linear(x[row:row + 1], weight, num_threads=1, isa=isa)
        assert torch.equal(alone[0], together[row])
    assert torch.equal(int4.int4_linear(x[5:22], weight, num_threads=2, isa=isa), together[5:22])


@pytest.mark.parametrize("n, k", LLAMA_8B_SHAPES)
def test_llama_8b_shapes(n, k):
    for batch in (1, 33):
        x, qweight, scales, mins = random_problem(n, k, 32, batch)
        weight = int4.TiledInt4.from_packed(qweight, scales, mins, 32)
        expected = int4.reference_linear(x, qweight, scales, mins, 32)
        for isa in ISAS:
            y = int4.int4_linear(x, weight, num_threads=2, isa=isa)
            assert relative_error(y, expected) <= KERNEL_TOLERANCE


@pytest.mark.parametrize("activation_bits", int4.ACTIVATION_BITS)
def test_zero_rows_and_zero_blocks_of_x(activation_bits):
    x, qweight, scales, mins = random_problem(40, 128, 64, 3)
    x[0] = 0  # an all-zero row: scale 0, no division by zero
    x[1, 32:64] = 0
    weight = int4.TiledInt4.from_packed(qweight, scales, mins, 64)
    expected = int4.reference_linear(x, qweight, scales, mins, 64, activation_bits)
    for isa in ISAS:
        y = int4.int4_linear(x, weight, num_threads=2, isa=isa, activation_bits=activation_bits)
        assert torch.equal(y[0], torch.zeros(40))
        assert relative_error(y, expected) <= KERNEL_TOLERANCE


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation_bits", int4.ACTIVATION_BITS)
def test_half_precision_input_returns_its_dtype(dtype, activation_bits):
    x, qweight, scales, mins = random_problem(72, 128, 32, 19)
    y = int4.int4_linear(x.to(dtype), int4.TiledInt4.from_packed(qweight, scales, mins, 32),
                         activation_bits=activation_bits)
    assert y.dtype == dtype
    expected = int4.reference_linear(x.to(dtype).float(), qweight, scales, mins, 32, activation_bits)
    assert relative_error(y.float(), expected) <= 1e-2  # the output's own rounding


@pytest.mark.parametrize("n", [1, 16, 33])
def test_tiling_is_a_reversible_permutation_of_the_bytes(n):
    _, qweight, scales, mins = random_problem(n, 192, 64, 1)
    tiled = int4.TiledInt4.from_packed(qweight, scales, mins, 64)
    assert tiled.codes.shape == (-(-n // 16), 192 // 32, 4, 16, 4) and (tiled.n, tiled.k) == (n, 192)
    for restored, original in zip(tiled.to_packed(), (qweight, scales, mins)):
        assert torch.equal(restored, original)
    # chunk i of a block holds bytes 4i..4i+3 of each of the tile's rows
    assert torch.equal(tiled.codes[0, 1, 2, 0], qweight[0, 16 + 8:16 + 12])


def test_pack_and_unpack_are_inverse_and_follow_gguf_block_order():
    levels = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    packed = int4.pack(levels)
    assert packed.shape == (5, 32) and torch.equal(int4.unpack(packed), levels)
    # byte i of a block: weight i in the low nibble, weight i + 16 in the high one
    assert int(packed[0, 3]) == int(levels[0, 3]) | (int(levels[0, 19]) << 4)
    assert int(packed[0, 16 + 3]) == int(levels[0, 32 + 3]) | (int(levels[0, 32 + 19]) << 4)


@pytest.mark.parametrize("group_size", int4.GROUP_SIZES)
def test_round_to_nearest_keeps_each_group_within_half_a_step(group_size):
    weight = torch.randn(16, 256) * torch.rand(16, 1)
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
])
def test_malformed_weights_are_refused(bad, message):
    k = bad.get("k", 64)
    qweight = torch.zeros(8, k // 2, dtype=bad.get("qweight_dtype", torch.uint8))
    scales = torch.ones(bad.get("scales_shape", (8, max(1, k // 32))))
    mins = torch.zeros(8, max(1, k // 32))
    with pytest.raises(ValueError, match=message):
        int4.TiledInt4.from_packed(qweight, scales, mins, bad.get("group_size", 32))


@pytest.mark.parametrize("bad, message", [(dict(k=96), "columns"), (dict(num_threads=0), "num_threads"),
                                          (dict(dtype=torch.int32), "x dtype"),
                                          (dict(activation_bits=4), "activation_bits")])
def test_malformed_calls_are_refused(bad, message):
    _, qweight, scales, mins = random_problem(8, 64, 32, 1)
    x = torch.ones(2, bad.get("k", 64), dtype=bad.get("dtype", torch.float32))
    with pytest.raises(ValueError, match=message):
        int4.int4_linear(x, int4.TiledInt4.from_packed(qweight, scales, mins, 32), num_threads=bad.get("num_threads", 1),
                         activation_bits=bad.get("activation_bits", 8))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_into_writes_the_weight_in_the_asked_dtype(isa, dtype):
    qweight, scales, mins = int4.quantize_rtn(torch.randn(70, 192), 64)
    expected = int4.dequantize(qweight, scales, mins, 64)
    out = torch.full((70, 192), float("nan"), dtype=dtype)
    int4.dequantize_into(int4.TiledInt4.from_packed(qweight, scales, mins, 64), out, num_threads=3, isa=isa)
    # one fused multiply-add against torch's multiply then add: the last bit may differ
    torch.testing.assert_close(out.float(), expected, atol=2e-6, rtol=torch.finfo(dtype).eps)


def test_thread_count_is_calibrated_within_the_cores():
    assert 1 <= int4.default_num_threads() <= len(os.sched_getaffinity(0))


def test_importing_tandem_caps_torchs_openmp_spinning_unless_set():
    code = "import engine, os; print(os.environ['GOMP_SPINCOUNT'])"
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    capped = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert capped.stdout.strip() == "3000"
    chosen = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            env={**env, "GOMP_SPINCOUNT": "7"})
    assert chosen.stdout.strip() == "7"
