"""Tensor parallelism: the model split over ranks (partition.py, sharded_loader.py,
parallel_linear.py), each rank a Ray actor (worker.py) driven by the engine's one scheduler
(executor.py, wire.py). Ray is imported only when a runner over several ranks starts."""
from engine.distributed.executor import TensorParallelRunner
from engine.distributed.partition import largest_rank_config
from engine.distributed.worker import ModelSource

__all__ = ["ModelSource", "TensorParallelRunner", "largest_rank_config"]
