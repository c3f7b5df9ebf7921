"""How the decoder layers cut into pipeline stages, what each stage loads and hands on, and the
flag values pipeline stages refuse at start, naming what to change."""
import pytest
import torch

from engine.config import EngineConfig
from engine.distributed.executor import require_resources
from engine.distributed.stages import Stage, StageLayers, StageLoader, plan_stages
from engine.model.layer_store import LayerStore
from engine.model_config import ConfigError
from engine.weights import EMBEDDED_MODEL, create_loader


@pytest.fixture(scope="module")
def embedded():
    return create_loader(EMBEDDED_MODEL)


def test_stages_are_contiguous_and_the_first_take_the_remainder(embedded):
    stages = plan_stages(embedded.config, 4)  # 30 layers
    assert [stage.layers for stage in stages] == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert stages[0].first and not stages[0].last and stages[3].last and stages[2].num_layers == 7
    with pytest.raises(ConfigError, match="use at most 30"):
        plan_stages(embedded.config, 31)
    moe = create_loader("qwen3-moe-tiny", "dummy").config
    with pytest.raises(ConfigError, match="--tensor-parallel-size"):
        plan_stages(moe, 2)


def test_a_stage_loads_its_own_layers_renumbered(embedded):
    stage = plan_stages(embedded.config, 3)[1]
    loader = StageLoader(embedded, stage)
    assert loader.config.num_layers == 10 and loader.config.hidden_size == embedded.config.hidden_size
    mine, theirs = loader.load_layer(0, torch.float32), embedded.load_layer(10, torch.float32)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[key], theirs[key]) for key in mine)


def test_a_later_stage_reads_the_previous_output_and_an_earlier_hands_its_own_on():
    store = LayerStore(torch.device("cpu"))
    first, middle, last = (StageLayers(store, Stage(index, 3, (index, index + 1))) for index in range(3))
    tokens, rows = torch.tensor([5, 6, 7]), torch.tensor([2])
    hidden = torch.randn(3, 4)
    assert torch.equal(first.stage_input(tokens, lambda ids: hidden), hidden)
    assert first.stage_output(hidden, rows, head=None).shape == (1, 0) and first.outgoing is hidden
    middle.incoming = hidden * 2
    assert torch.equal(middle.stage_input(tokens, embed=None), hidden * 2) and middle.incoming is None
    with pytest.raises(RuntimeError, match="previous stage's output"):
        middle.stage_input(tokens, embed=None)  # none was handed on
    assert torch.equal(last.stage_output(hidden, rows, lambda h, r: h[r]), hidden[rows])
    assert not middle.graph_capturable


@pytest.mark.parametrize("flags, named", [
    (dict(pipeline_parallel_size=2, cpu_attention="on"), "--cpu-attention off"),
    (dict(pipeline_parallel_size=2, gpu_memory_gib=1.0), "--pipeline-parallel-size 2 does not combine with --gpu-memory-gib"),
])
def test_pipeline_stages_refuse_what_they_do_not_combine_with(flags, named):
    with pytest.raises(ConfigError, match=named):
        EngineConfig.from_flat(**flags)


def test_stages_take_tensor_parallel_ranks():
    assert EngineConfig.from_flat(pipeline_parallel_size=2, tensor_parallel_size=2).parallel.num_ranks == 4


def test_stages_leave_neo_off_by_default_on_the_testbed():
    assert EngineConfig.from_flat(device="testbed").cpu_attention_enabled
    assert not EngineConfig.from_flat(device="testbed", pipeline_parallel_size=2).cpu_attention_enabled


class _Cluster:
    """What require_resources asks of Ray."""

    def __init__(self, **resources) -> None:
        self.resources = resources

    def cluster_resources(self) -> dict:
        return self.resources


def test_ranks_the_cluster_cannot_place_are_refused_naming_the_flags():
    require_resources(_Cluster(CPU=4.0), 4, False, "-pp 2 -tp 2")
    with pytest.raises(ConfigError, match=r"-pp 2 -tp 2 needs 4 CPUs \(the Ray cluster has 3\)"):
        require_resources(_Cluster(CPU=3.0), 4, False, "-pp 2 -tp 2")
    with pytest.raises(ConfigError, match=r"needs 2 GPUs \(the Ray cluster has 1\)"):
        require_resources(_Cluster(CPU=8.0, GPU=1.0), 2, True, "--data-parallel-size 2")
