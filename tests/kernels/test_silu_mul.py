"""SwiGLU's fused silu(gate) * up against the model's torch ops on fresh random rows, every ISA this
machine runs, each dtype; and the model choosing it."""
import pytest
import torch

from engine.model.layers import fused_silu_mul, silu_mul
from kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.is_available(), reason="the CPU kernels are not built")
ISAS = cpu.usable_isas() if cpu.is_available() else []


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, width", [(1, 1536), (5, 16), (33, 256)])
def test_matches_the_torch_ops(isa, dtype, rows, width):
    gate_up = (torch.randn(rows, 2 * width) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # e^-x far outside the fp32 range, and zero
    got = cpu.silu_mul(gate_up, isa=isa)
    assert got.dtype == dtype and got.shape == (rows, width)
    # e^x within an ulp or two of torch's, then at most one rounding step of the dtype apart per op
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got, silu_mul(gate_up), rtol=max(4 * eps, 1e-6), atol=1e-6)


def test_shapes_the_kernel_cannot_take_use_the_torch_ops():
    gate_up = torch.randn(3, 40)  # halves of 20: not a multiple of 16
    assert torch.equal(fused_silu_mul(gate_up), silu_mul(gate_up))
    with pytest.raises(ValueError, match="silu_mul takes"):
        cpu.silu_mul(gate_up)
