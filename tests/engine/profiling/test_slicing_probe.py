"""ScheInfer's profile on a tiny model: the points are measured and fitted on the engine's own
queues, copy engines and weight objects, and cached beside the cost tables under their key.

Times are never compared with expectations (they vary by machine and load): the tests check that
every model was fitted from distinct volumes, grows with its volume, and is cached per kind."""
import json

import pytest
import torch

from engine.device.queues import InlineQueue, WorkerThreadQueue
from engine.device.cores import CoreAssignment
from engine.offload.transfer import create_copy_engine
from engine.model_config import ModelConfig
from engine.profiling.cache import ProfileKey, load_cached, load_or_measure, profile_path
from engine.profiling.slicing_probe import _weights, measure_slicing_costs
from scheduler.planning import SlicingCosts

TINY = dict(architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)


def _queue(device: str):
    if device == "testbed":
        return WorkerThreadQueue(None, 1, name="tandem-test-gpu")
    return InlineQueue("cpu")


@pytest.mark.parametrize("device", ["cpu", "testbed"])
def test_every_model_is_fitted_and_grows_with_its_volume(device):
    config = ModelConfig.from_hf_dict(TINY)
    cores = CoreAssignment.for_device("cpu")
    queue, engine = _queue(device), create_copy_engine("cpu")
    try:
        costs = measure_slicing_costs(config, torch.float32, "dense", queue, engine, cores)
    finally:
        engine.close()
        queue.close()
    for gemm in (costs.gpu_gemm, costs.cpu_gemm):
        assert gemm.r_squared is not None and gemm.time_s(1e9, 1e8) > gemm.time_s(1e3, 1e2)
    assert costs.link.r_squared is not None and costs.link.time_s(1e8) > costs.link.time_s(1e3)
    assert costs.launch_s > 0
    assert min(costs.cpu_gemm_slowdown, costs.gpu_gemm_slowdown, costs.link_slowdown) >= 1


def test_slicing_models_are_cached_beside_the_tables_under_the_same_key(tmp_path):
    key = ProfileKey.create(model="smollm2-135m", load_format="dummy", dtype=torch.float32, device="cpu",
                            gpu_threads=1, cpu_attention_threads=1, block_size=16)
    costs = SlicingCosts.from_dict({"gpu_gemm": {"a_s": 1e-6, "b_s_per_multiply_add": 1e-12,
                                                         "b_s_per_weight_byte": 0.0},
                                    "cpu_gemm": {"a_s": 2e-6, "b_s_per_multiply_add": 4e-12, "b_s_per_weight_byte": 1e-11},
                                    "link": {"a_s": 5e-6, "b_s_per_unit": 1e-10, "unit": "bytes", "r_squared": 0.99},
                                    "launch_s": 3e-5, "cpu_gemm_slowdown": 1.5, "gpu_gemm_slowdown": 1.2,
                                    "link_slowdown": 1.1, "copies_on_cpu": True, "handoff_s": 7e-5})
    calls = []

    def build():
        calls.append(1)
        return costs
    for _ in range(2):
        got = load_or_measure(key, "slicing-dense", build, SlicingCosts.to_dict, SlicingCosts.from_dict, tmp_path)
        assert got == costs
    assert len(calls) == 1
    path = profile_path(key, tmp_path, "slicing-dense")
    assert path.name == f"{key.digest}.slicing-dense.json"
    assert json.loads(path.read_text())["key"] == key.to_dict()
    assert load_cached(key, tmp_path) is None  # the cost tables are another file
    other = ProfileKey.create(model="smollm2-135m", load_format="dummy", dtype=torch.bfloat16, device="cpu",
                              gpu_threads=1, cpu_attention_threads=1, block_size=16)
    load_or_measure(other, "slicing-dense", build, SlicingCosts.to_dict, SlicingCosts.from_dict, tmp_path)
    assert len(calls) == 2


def _storages(weight) -> list[int]:
    """The storages behind a weight object's tensors (INT4's tiles one level down)."""
    found = []
    for value in vars(weight).values():
        tensors = vars(value).values() if hasattr(value, "__dict__") and not isinstance(value, torch.Tensor) else [value]
        found += [t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor)]
    return found


@pytest.mark.parametrize("method", ["dense", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_probes_cold_copies_are_copies(method, dtype):
    """Each copy of a probed slice has storage of its own, in every dtype: a cast to the weight's own
    dtype returns the same tensor, and fp32 copies made that way were one warm weight timed over."""
    weights = _weights((128, 128), method, dtype, torch.device("cpu"))
    storages = [ptr for weight in weights for ptr in _storages(weight)]
    assert len(weights) > 1 and storages
    assert len(set(storages)) == len(storages)
