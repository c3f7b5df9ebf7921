"""The decode-step GEMV against torch's fp64 product on fresh random inputs, every ISA and weight
dtype; the dense weight object using it for a few rows and torch's GEMM otherwise."""
import pytest
import torch
import torch.nn.functional as F

from engine.quant import create_linear_method
from kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.is_available(), reason="the CPU kernels are not built")
ISAS = cpu.usable_isas() if cpu.is_available() else []


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("n, k", [(576, 576), (1, 16), (67, 1536)])
def test_matches_the_fp64_product(isa, dtype, rows, n, k):
    weight = torch.randn(n, k).to(dtype)
    x = torch.randn(rows, k).to(dtype)
    expected = x.double() @ weight.double().T
    got = cpu.dense_linear(x, weight, num_threads=2, isa=isa)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert float((got.double() - expected).abs().max() / expected.abs().max()) <= 1e-5


@pytest.mark.parametrize("rows", [1, 8, 9])
def test_dense_weight_gives_torchs_result_either_way(rows):
    weight, bias = torch.randn(96, 64), torch.randn(96)
    linear = create_linear_method("dense").create_weight(weight, bias, dtype=torch.bfloat16,
                                                        device=torch.device("cpu"))
    x = torch.randn(rows, 64).bfloat16()
    torch.testing.assert_close(linear.apply(x), F.linear(x, weight.bfloat16(), bias.bfloat16()),
                               rtol=2 * torch.finfo(torch.bfloat16).eps, atol=1e-2)


def test_malformed_calls_are_refused():
    with pytest.raises(ValueError, match="dense_linear takes"):
        cpu.dense_linear(torch.randn(9, 16), torch.randn(8, 16))
    with pytest.raises(ValueError, match="k a positive multiple"):
        cpu.dense_linear(torch.randn(1, 20), torch.randn(8, 20))
