"""The linear-method seam: weight objects (dense, INT4) against a plain matmul on fresh random
inputs, the registry, and the model applying every matmul through weight objects. (An INT4 model
against the dense model of its own dequantized weights: tests/benchmarks/kernels/test_accuracy.py.)"""
import re
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig, Int4Prefill
from engine.model_config import ConfigError
from engine.quant import LinearWeight, create_linear_method, linear_method_names
from engine.quant.base import ConcatWeight
from engine.quant.int4 import (MAX_INT16_ROWS, CpuInt4Kernels, Int4Weight, KeepDense, PackedInt4,
                               TritonInt4Kernels, fuse)
from kernels.cpu import int4

MODEL_DIR = Path(__file__).resolve().parents[3] / "engine" / "model"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_dense_weight_matches_a_plain_matmul(dtype, with_bias):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 32, generator=gen)
    bias = torch.randn(48, generator=gen) if with_bias else None
    x = torch.randn(5, 32, generator=gen).to(dtype)
    linear = create_linear_method("dense").create_weight(weight, bias, dtype=dtype, device=torch.device("cpu"))
    assert isinstance(linear, LinearWeight) and linear.method == "dense"
    assert (linear.out_features, linear.in_features) == (48, 32)
    expected = x.float() @ weight.to(dtype).float().T + (0 if bias is None else bias.to(dtype).float())
    tolerance = 1e-5 if dtype is torch.float32 else 5e-2
    torch.testing.assert_close(linear.apply(x).float(), expected, atol=tolerance, rtol=tolerance)
    assert linear.apply(x).dtype == dtype
    assert linear.nbytes == (48 * 32 + (48 if with_bias else 0)) * dtype.itemsize


def test_unknown_linear_method_names_the_known_ones():
    with pytest.raises(ValueError, match="dense"):
        create_linear_method("int3")
    assert "dense" in linear_method_names()


def test_model_code_multiplies_only_through_weight_objects():
    """No F.linear / matmul on a bare weight tensor in the model: formats plug in at the seam."""
    bare = re.compile(r"\b(F\.linear|functional\.linear|torch\.matmul|\.mm\(|@ )")
    for path in MODEL_DIR.glob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            assert not bare.search(line), f"{path.name}:{number}: {line.strip()}"


@pytest.mark.parametrize("prefill", [prefill.value for prefill in Int4Prefill])
@pytest.mark.parametrize("rows", [1, 3, 40, MAX_INT16_ROWS, MAX_INT16_ROWS + 1, 300])
def test_int4_weight_applies_like_its_dequantized_matrix(rows, prefill, monkeypatch):
    """The packed kernel (int16 x up to MAX_INT16_ROWS; above, int8 x with prefill int8, int16 with
    prefill int16) and the dequantized weight (above, by default) agree with a plain matmul over the
    weight the packed form stands for, bias included; with prefill int8 or int16 the weight is never widened."""
    if prefill != "dequantize":
        monkeypatch.setattr(int4, "dequantize_into", None)
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(300, 256, generator=gen), torch.randn(300, generator=gen)
    linear = create_linear_method("int4", prefill=prefill).create_weight(weight, bias, dtype=torch.float32,
                                                       device=torch.device("cpu"))
    dense = linear.dequantize()
    x = torch.randn(rows, 256, generator=gen)
    expected = x @ dense.T + bias
    tolerance = (int4.ACTIVATION_RELATIVE_ERROR[16] if rows <= MAX_INT16_ROWS or prefill == "int16" else
                 int4.ACTIVATION_RELATIVE_ERROR[8] if prefill == "int8" else 1e-5)
    assert float((linear.apply(x) - expected).abs().max() / expected.abs().max()) <= tolerance
    tiles = -(-300 // 16)
    assert linear.format == "int4" and linear.nbytes == tiles * 16 * (128 + 2 * 8 * 4) + 300 * 4


@pytest.mark.parametrize("rows", [3, MAX_INT16_ROWS + 12])
def test_int4_fused_parts_of_several_kinds_apply_like_their_concatenation(rows):
    """A fused weight whose parts a loader handed over as packed, kept-dense and plain weights
    (GGUF Q/K in 4 bits, V in 6, say): runs of one kind are concatenated, each run becomes a
    weight of its own (packed as it is, dense, int4 by round-to-nearest), the bias is split
    among them, and the whole applies like x @ [W_1; W_2; ...]^T + bias."""
    gen = torch.Generator().manual_seed(rows)

    def packed(n: int) -> PackedInt4:
        return PackedInt4(*int4.quantize_rtn(torch.randn(n, 64, generator=gen)), 32)

    parts = [packed(32), packed(16), KeepDense(torch.randn(16, 64, generator=gen)), torch.randn(8, 64, generator=gen)]
    runs = fuse(parts)
    assert [type(run) for run in runs] == [PackedInt4, KeepDense, torch.Tensor] and runs[0].shape == (48, 64)
    bias = torch.randn(72, generator=gen)
    linear = create_linear_method("int4").create_weight(runs, bias, dtype=torch.float32, device=torch.device("cpu"))
    assert isinstance(linear, ConcatWeight) and (linear.out_features, linear.in_features) == (72, 64)
    assert [part.format for part in linear.parts] == ["int4", "float32", "int4"]
    rounded = linear.parts[2]
    dense = torch.cat([runs[0].dequantize(), runs[1].weight, rounded.dequantize()])
    x = torch.randn(rows, 64, generator=gen)
    expected = x @ dense.T + bias  # x quantized in the kernel (int4.ACTIVATION_RELATIVE_ERROR)
    tolerance = int4.ACTIVATION_RELATIVE_ERROR[16] if rows <= MAX_INT16_ROWS else 1e-5
    assert float((linear.apply(x) - expected).abs().max() / expected.abs().max()) <= tolerance
    assert linear.nbytes == sum(part.nbytes for part in linear.parts)
    assert fuse(parts[:2]).shape == (48, 64) and isinstance(fuse(parts[:2]), PackedInt4)


def test_int4_weights_refuse_a_device_without_their_kernels():
    with pytest.raises(ValueError, match="no kernels for device meta; they run on cpu, cuda"):
        create_linear_method("int4").create_weight(torch.randn(32, 32), None, dtype=torch.float32,
                                                   device=torch.device("meta"))
    with pytest.raises(ConfigError, match="quantization int4 runs on device cpu or cuda, not on the testbed"):
        EngineConfig.from_flat(quantization="int4", device="testbed")
    assert EngineConfig.from_flat(quantization="int4", device="cuda").quantization == "int4"
    with pytest.raises(ConfigError, match="quantization"):
        EngineConfig.from_flat(quantization="int3")


def test_int4_weights_pick_the_kernels_of_their_device():
    linear = create_linear_method("int4").create_weight(torch.randn(64, 64), None, dtype=torch.float32,
                                                       device=torch.device("cpu"))
    assert isinstance(linear.kernels, CpuInt4Kernels)


@pytest.mark.parametrize("rows", [3, 20])
def test_int4_weight_on_the_triton_kernels_matches_the_cpu_kernels(interpreted_w4a16, rows):
    """The CUDA kernels forced onto CPU tensors (Triton's interpreter), through the packed path
    (3 rows) and the scratch buffer (20), against the same weight on the C++ kernels."""
    gen = torch.Generator().manual_seed(100 + rows)
    weight, bias = torch.randn(67, 192, generator=gen), torch.randn(67, generator=gen)
    method = create_linear_method("int4")
    on_cpu = method.create_weight(weight, bias, dtype=torch.float32, device=torch.device("cpu"))
    on_triton = Int4Weight(on_cpu.kernels.to_packed(on_cpu.weight), on_cpu.bias, method.scratch,
                           TritonInt4Kernels(), torch.device("cpu"))
    x = torch.randn(rows, 192, generator=gen)
    # Triton keeps x in fp32: the exact product, where the C++ kernel's int8 x is 1e-2 off
    torch.testing.assert_close(on_triton.apply(x), x @ on_cpu.dequantize().T + bias, atol=1e-4, rtol=1e-4)


def test_the_triton_kernels_keep_scales_in_fp16_only_where_that_is_exact(interpreted_w4a16):
    """GGUF Q4_0/Q4_1-like fp16 scales and mins are kept as fp16 (half their bytes); round-to-nearest's
    fp32 ones stay fp32. Either way the weight it stands for is unchanged."""
    gen = torch.Generator().manual_seed(7)
    levels = torch.randint(0, 16, (32, 64), generator=gen, dtype=torch.uint8)
    exact = PackedInt4(int4.pack(levels), torch.rand(32, 2, generator=gen).half().float(),
                       -torch.rand(32, 2, generator=gen).half().float(), 32)
    rounded = PackedInt4(*int4.quantize_rtn(torch.randn(32, 64, generator=gen), 32), 32)
    kernels = TritonInt4Kernels()
    for packed, dtype in ((exact, torch.float16), (rounded, torch.float32)):
        prepared = kernels.prepare(packed, torch.device("cpu"))
        assert prepared.scales.dtype == prepared.mins.dtype == dtype
        back = kernels.to_packed(prepared)
        assert back.scales.dtype == torch.float32 and torch.equal(back.dequantize(), packed.dequantize())


def test_int8_prefill_is_refused_off_the_cpu():
    with pytest.raises(ConfigError, match="int4_prefill int8 runs on device cpu"):
        EngineConfig(device="cuda", int4_prefill="int8")
    with pytest.raises(ValueError, match="CUDA's dequantize"):
        TritonInt4Kernels("int8")
    with pytest.raises(ValueError, match="int4 prefill must be one of"):
        create_linear_method("int4", prefill="int2").create_weight(torch.randn(16, 64), None, dtype=torch.float32,
                                                                  device="cpu")
