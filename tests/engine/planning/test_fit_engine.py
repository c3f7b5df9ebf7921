"""The fit as the engine runs it (engine/planning/fit.py): from two budgets, an engine whose
memory is what the fit planned, whose greedy tokens are the resident engine's, and `tandem plan`
answering for every preset with no budget flag."""
import pytest

from engine import LLM
from engine.config import EngineConfig
from engine.planning.fit import fit_options
from engine.model_config import list_presets
from engine.weights import create_loader
from scheduler.sampling_params import SamplingParams
from server.cli import main

GIB = 2**30
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[1, 504, 3287, 314, 260, 1142, 30], [1, 11, 1245, 28, 443, 9]]


def planned_and_started_bytes(llm: LLM) -> tuple[tuple[int, int], tuple[int, int]]:
    """(GPU, host) bytes of weights, layer buffers and KV pools: as the fit planned them, as the
    started engine holds them."""
    engine = llm.engine
    chosen = engine.plan.fit.chosen
    planned = (chosen.gpu_weight_bytes + chosen.gpu_kv_bytes, chosen.host_layer_bytes + chosen.host_kv_bytes)
    weights = engine.runner.model.weight_bytes()
    by_tier = {tier: sum(n for (_, t), n in weights.items() if t == tier) for tier in ("gpu", "host")}
    kv = engine.runner.kv_cache
    host_pool = kv.cpu.num_blocks * engine.kv_bytes_per_token * kv.cpu.block_size if kv.cpu is not None else 0
    started = (by_tier["gpu"] + kv.gpu.num_blocks * engine.kv_bytes_per_token * kv.gpu.block_size,
               by_tier["host"] + host_pool)
    return planned, started


def test_a_testbed_fit_holds_what_it_planned_and_the_resident_engines_tokens():
    """0.45 GiB for the GPU: the embedded model's dense layers do not all fit; some stream from host memory."""
    flat = dict(device="testbed", dtype="float32", max_num_seqs=8, max_model_len=1024, expected_context_len=256,
                profile_grid="quick")
    with LLM(gpu_memory_gib=0.45, host_memory_gib=1.0, **flat) as llm:
        assert llm.engine.config.quantization == "none"  # INT4 does not run on the testbed
        # some layers stream from host memory (how many is the measured model's call: near-ties here)
        assert llm.engine.plan.layers.placement.num_layers_in("host") > 0
        planned, started = planned_and_started_bytes(llm)
        for plan, engine in zip(planned, started):
            assert engine == pytest.approx(plan, rel=0.10)
        assert started[0] <= 0.45 * GIB and started[1] <= 1.0 * GIB
        fitted = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    with LLM(quantization="none", cpu_attention="off", **{k: v for k, v in flat.items() if k != "device"}) as llm:
        assert fitted == [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_the_options_run_from_lossless_to_lossiest():
    config = EngineConfig.from_flat(device="cpu")
    import torch

    names = [(o.quantization, o.kv.name) for o in fit_options(config, False, torch.bfloat16, 64)]
    assert names == [("none", "bfloat16"), ("none", "int8"), ("int4", "bfloat16"), ("int4", "int8"),
                     ("none", "k8v4"), ("int4", "k8v4"), ("none", "int4"), ("int4", "int4")]
    packed = fit_options(config, True, torch.bfloat16, 64)
    assert [(o.quantization, o.kv.name) for o in packed] == [("int4", "bfloat16"), ("int4", "int8"), ("int4", "k8v4"),
                                                             ("int4", "int4")]
    testbed = fit_options(EngineConfig.from_flat(device="testbed"), True, torch.float32, 64)
    assert {o.quantization for o in testbed} == {"none"}  # INT4 does not run there, packed or not
    assert [o.kv.name for o in fit_options(config, False, torch.bfloat16, 48)] == ["bfloat16", "bfloat16"]


@pytest.mark.slow
@pytest.mark.parametrize("preset, gpu_gib, host_gib", [("smollm2-135m", 0.4, 1.0), ("qwen2-0.5b", 1.2, 2.0),
                                                       ("llama-3.2-1b", 3.0, 3.0)])
def test_the_plans_memory_is_within_a_tenth_of_the_started_engines(preset, gpu_gib, host_gib):
    with LLM(preset, load_format="dummy", device="testbed", dtype="float32", gpu_memory_gib=gpu_gib,
             host_memory_gib=host_gib, max_num_seqs=8, max_model_len=1024, expected_context_len=512,
             profile_grid="quick") as llm:
        planned, started = planned_and_started_bytes(llm)
        for plan, engine in zip(planned, started):
            assert engine == pytest.approx(plan, rel=0.10)


@pytest.mark.slow
@pytest.mark.parametrize("preset", list_presets())
def test_plan_answers_for_every_preset_with_no_budget_flag(preset, capsys, tmp_path, monkeypatch):
    """A fit, or (a model larger than the memory: a mixture-of-experts one, or a dense one where the
    offload directory's disk has no room for what memory lacks) the flags that would place it."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    code = main(["plan", "--model", preset, "--load-format", "dummy", "--log-level", "warning"])
    out, err = capsys.readouterr()
    if code == 2 and create_loader(preset, "dummy").config.is_moe:
        assert "--hot-experts auto --weights-gpu-gib" in err and "--mlp-slicing auto" in err
    elif code == 2:
        assert "does not fit" in err and "give more --gpu-memory-gib / --host-memory-gib" in err
    else:
        assert code == 0 and "fit:" in out and "threads:" in out, err
