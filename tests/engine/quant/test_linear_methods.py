"""The linear-method seam: weight objects (dense, INT4) against a plain matmul on fresh random
inputs, the registry, the model applying every matmul through weight objects, and an INT4 model
against the dense model of its own dequantized weights."""
import re
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.execution import ModelRunner
from engine.model import ConfigError
from engine.quant import LinearWeight, create_linear_method, linear_method_names
from engine.quant.int4 import MAX_KERNEL_ROWS, CpuInt4Kernels, Int4Weight, TritonInt4Kernels
from engine.weights import EMBEDDED_MODEL, create_loader
from kernels.cpu import int4
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.sequence import Sequence

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


@pytest.mark.parametrize("rows", [1, 3, MAX_KERNEL_ROWS, MAX_KERNEL_ROWS + 1, 40])
def test_int4_weight_applies_like_its_dequantized_matrix(rows):
    """The packed kernel (small batches) and the dequantized tiles (large ones) agree with a
    plain matmul over the weight the packed form stands for, bias included."""
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(300, 256, generator=gen), torch.randn(300, generator=gen)
    linear = create_linear_method("int4").create_weight(weight, bias, dtype=torch.float32,
                                                       device=torch.device("cpu"))
    dense = int4.dequantize(linear.qweight, linear.scales, linear.mins, linear.group_size)
    x = torch.randn(rows, 256, generator=gen)
    torch.testing.assert_close(linear.apply(x), x @ dense.T + bias, atol=1e-4, rtol=1e-4)
    assert linear.format == "int4" and linear.nbytes == 300 * 128 + 2 * 300 * 8 * 4 + 300 * 4


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
    on_triton = Int4Weight(on_cpu.qweight, on_cpu.scales, on_cpu.mins, on_cpu.group_size, on_cpu.bias,
                           method.scratch, TritonInt4Kernels())
    x = torch.randn(rows, 192, generator=gen)
    torch.testing.assert_close(on_triton.apply(x), on_cpu.apply(x), atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_int4_model_decodes_like_the_dense_model_of_its_dequantized_weights():
    """The embedded model with INT4 layers gives the greedy tokens (and, to fp32 rounding, the
    logits) of the same model whose layers hold the dequantized INT4 weights as dense matrices:
    prefill through the tiled path, decode through the packed kernel."""
    loader = create_loader(EMBEDDED_MODEL)
    runners = {method: ModelRunner(loader.config, loader, dtype=torch.float32, device="cpu", num_blocks=64,
                                   block_size=16, max_model_len=256, linear_method=method)
               for method in ("int4", "dense")}
    for packed, dense in zip(runners["int4"].model.layers, runners["dense"].model.layers):
        for name in ("qkv", "o_proj", "gate_up", "down"):
            weight = getattr(packed, name)
            getattr(dense, name).weight = int4.dequantize(weight.qweight, weight.scales, weight.mins,
                                                          weight.group_size)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, loader.config.vocab_size, (n,), generator=gen).tolist() for n in (12, 30, 7)]
    tokens = {}
    for method, runner in runners.items():
        sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=16, max_model_len=256))
        seqs = [Sequence(str(i), p, SamplingParams(max_tokens=6, temperature=0.0)) for i, p in enumerate(prompts)]
        for seq in seqs:
            sched.add_sequence(seq)
        logits = []
        while sched.has_unfinished_sequences():
            plan = sched.schedule()
            step_logits = runner.compute_logits(plan)
            logits.append(step_logits)
            sched.update(plan, step_logits.argmax(dim=-1).tolist())
        tokens[method] = [seq.output_token_ids for seq in seqs]
        runners[method] = logits
    assert tokens["int4"] == tokens["dense"]
    for packed_logits, dense_logits in zip(runners["int4"], runners["dense"]):
        torch.testing.assert_close(packed_logits, dense_logits, atol=2e-3, rtol=2e-3)
