"""The fused RoPE against the model's torch RoPE on fresh random heads, every ISA this machine
runs, each dtype; the torch path kept where the kernel does not apply."""
import pytest
import torch

from engine.model.layers import RotaryEmbedding
from kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.is_available(), reason="the CPU kernels are not built")
ISAS = cpu.usable_isas() if cpu.is_available() else []


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens, heads, head_dim", [(1, 12, 64), (5, 3, 128), (33, 2, 64)])
def test_matches_the_torch_rope(isa, dtype, tokens, heads, head_dim):
    rope = RotaryEmbedding(head_dim, 10000.0, None, 512, torch.device("cpu"))
    x = torch.randn(tokens, heads, head_dim).to(dtype)
    positions = torch.randint(0, 512, (tokens,))
    got = cpu.rope(x, positions, rope.cos, rope.sin, isa=isa)
    expected = rope(x, positions)  # the torch ops (fused is off by default)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, expected, rtol=2 * torch.finfo(dtype).eps, atol=1e-6)


def test_the_model_rope_uses_the_kernel_only_where_it_applies():
    fused = RotaryEmbedding(80, 10000.0, None, 64, torch.device("cpu"), fused=True)  # 80: not a multiple of 32
    plain = RotaryEmbedding(80, 10000.0, None, 64, torch.device("cpu"))
    x, positions = torch.randn(3, 2, 80), torch.tensor([0, 5, 63])
    assert torch.equal(fused(x, positions), plain(x, positions))
    with pytest.raises(ValueError, match="rope takes"):
        cpu.rope(x, positions.int(), plain.cos, plain.sin)
