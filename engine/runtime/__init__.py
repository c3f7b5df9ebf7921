"""The runtime of a forward: batch packing, the model runner that executes an IterationPlan, Neo's
two-batch pipeline and CUDA graphs of the decode step."""
from engine.runtime.batch import BatchInputs, build_batch
from engine.runtime.pipeline import PipelineTimes, pipelined_forward
from engine.runtime.runner import ForwardLogits, ModelRunner, RunnerOutput

__all__ = ["BatchInputs", "ForwardLogits", "ModelRunner", "PipelineTimes", "RunnerOutput", "build_batch",
           "pipelined_forward"]
