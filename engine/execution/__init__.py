"""Executing a plan: batch packing, the model runner, GPU queues, Neo's two-batch
pipeline and core pinning."""
from engine.execution.batch import BatchInputs, build_batch
from engine.execution.cores import CoreAssignment
from engine.execution.pipeline import PipelineTimes, pipelined_forward
from engine.execution.queues import GpuQueue, CudaStreamQueue, Future, InlineQueue, WorkerThreadQueue
from engine.execution.runner import ForwardLogits, ModelRunner, RunnerOutput

__all__ = ["GpuQueue", "BatchInputs", "ForwardLogits", "CoreAssignment", "CudaStreamQueue", "Future", "InlineQueue",
           "ModelRunner", "PipelineTimes", "RunnerOutput", "WorkerThreadQueue", "build_batch",
           "pipelined_forward"]
