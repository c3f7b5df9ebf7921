"""The linear-method seam: weight objects against a plain matmul on fresh random inputs, the
registry, and the model applying every matmul through weight objects."""
import re
from pathlib import Path

import pytest
import torch

from engine.quant import LinearWeight, create_linear_method, linear_method_names

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
