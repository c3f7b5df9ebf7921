"""The fused RMSNorm against the model's torch RMSNorm on fresh random rows, every ISA this
machine runs, each dtype; and the model choosing it."""
import pytest
import torch

from engine.model.layers import fused_rms_norm, rms_norm
from kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.is_available(), reason="the CPU kernels are not built")
ISAS = cpu.usable_isas() if cpu.is_available() else []


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, hidden", [(1, 576), (7, 64), (32, 4096)])
def test_matches_the_torch_rms_norm(isa, dtype, rows, hidden):
    x = (torch.randn(rows, hidden) * 3).to(dtype)
    weight = (torch.rand(hidden) + 0.5).to(dtype)
    expected = rms_norm(x, weight, 1e-5)
    got = cpu.rms_norm(x, weight, 1e-5, isa=isa)
    assert got.dtype == dtype and got.shape == x.shape
    # fp32 sums of squares in another order (4096 of them in sequence on the scalar path: about
    # 1e-6 apart), then at most one rounding step of the dtype
    torch.testing.assert_close(got, expected, rtol=max(2 * torch.finfo(dtype).eps, 1e-5), atol=1e-6)


def test_shapes_the_kernel_cannot_take_use_the_torch_ops():
    x, weight = torch.randn(3, 40), torch.rand(40)  # 40: not a multiple of 16
    assert torch.equal(fused_rms_norm(x, weight, 1e-6), rms_norm(x, weight, 1e-6))
    with pytest.raises(ValueError, match="rms_norm takes"):
        cpu.rms_norm(x, weight.double(), 1e-6)
