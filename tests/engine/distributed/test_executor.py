"""The driver's reading of the ranks' results (no Ray here): which failures are the plan's and
which leave the ranks out of step; each rank's cores."""
import pytest

from engine.device.cores import rank_core_sets
from engine.distributed.executor import RankLostError, TensorParallelRunner
from engine.distributed.stages import Stage
from engine.distributed.worker import RankFailure
from scheduler.iteration_plan import IterationPlan


def runner(world_size: int, num_stages: int = 1) -> TensorParallelRunner:
    instance = TensorParallelRunner.__new__(TensorParallelRunner)
    instance.world_size, instance._lost, instance.vocab_size = world_size, False, 8
    instance.stages = [Stage(index, num_stages, (index, index + 1)) for index in range(num_stages)] \
        if num_stages > 1 else None
    return instance


def test_the_same_failure_on_every_rank_is_the_plans():
    two = runner(2)
    error = ValueError("a bad plan")
    with pytest.raises(ValueError, match="a bad plan"):
        two._raise_failures([RankFailure(0, "ValueError: a bad plan", error), RankFailure(1, "ValueError: a bad plan",
                                                                                         error)])
    assert not two._lost


@pytest.mark.parametrize("failures", [
    [RankFailure(1, "RuntimeError: out of memory", RuntimeError())],
    [RankFailure(0, "ValueError: x", ValueError()), RankFailure(1, "TimeoutError: waited", TimeoutError())],
])
def test_a_failure_of_some_ranks_loses_them(failures):
    two = runner(2)
    with pytest.raises(RankLostError, match=f"rank {failures[0].rank} failed alone"):
        two._raise_failures(failures)
    assert two._lost


def test_a_pipeline_stages_failure_is_the_plans():
    """The stages after a failed one pass its failure on: none is out of step."""
    stages = runner(1, num_stages=3)
    stages._run_step = lambda plan: [RankFailure(0, "ValueError: a bad plan", ValueError("a bad plan"))]
    with pytest.raises(ValueError, match="a bad plan"):
        stages.execute(IterationPlan())
    assert not stages._lost


def test_each_rank_gets_its_own_run_of_cores():
    assert rank_core_sets([0, 1, 2, 3, 4], 2) == [(0, 1), (2, 3)]
    assert rank_core_sets([0], 2) == [(), ()]
