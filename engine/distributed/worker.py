"""One tensor-parallel rank: a process (a Ray actor) holding its shard of the model, both of its
KV pools and its own cores, running each iteration's plan in lock-step with the other ranks."""
from __future__ import annotations

import logging
import os
import pickle
import socket
import threading
from dataclasses import dataclass

import torch

from engine.distributed.collectives import create_collectives
from engine.distributed.parallel_linear import TensorParallelLayers
from engine.distributed.partition import RankShard
from engine.distributed.sharded_loader import ShardedLoader
from engine.distributed.stages import Stage, StageLayers, StageLoader
from engine.device.cores import CoreAssignment
from engine.runtime.runner import ModelRunner, RunnerOutput
from engine.offload.stats import WeightStats
from engine.model_config import ModelConfig
from engine.model.layer_store import LayerStore
from engine.model.moe import ResidentMoeLayers
from engine.weights import create_loader
from scheduler.planning.cost_model import TableCostModel
from scheduler.iteration_plan import IterationPlan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankReport:
    """What a built rank tells the driver."""

    rank: int  # its tensor-parallel rank within its stage
    pid: int
    actor_id: str  # Ray's id of this rank's actor (hex), which its errors name
    cores: CoreAssignment
    num_gpu_blocks: int
    weight_bytes: dict[tuple[str, str], int]
    stage: int | None = None  # its pipeline stage (None: no pipeline)

    @property
    def name(self) -> str:
        return worker_name(self.rank, self.stage)


def worker_name(rank: int, stage: int | None) -> str:
    """A rank as logs and errors name it: its stage's rank 0 by its stage alone."""
    if stage is None:
        return f"tensor-parallel rank {rank}"
    return f"pipeline stage {stage}" + (f" rank {rank}" if rank else "")


@dataclass(frozen=True)
class RankFailure:
    """A rank's step that raised."""

    rank: int
    message: str
    error: BaseException


def _picklable(exc: BaseException) -> BaseException:
    """`exc`, or a RuntimeError with its message where it would not survive the trip to the driver."""
    try:
        pickle.dumps(exc)
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


@dataclass(frozen=True)
class ModelSource:
    """Where every rank loads its shard from (each reads the checkpoint itself)."""

    model: str
    load_format: str
    seed: int


class RankWorker:
    """Rank `shard.rank`'s process: connect, build, then one `execute` per iteration."""

    def __init__(self, shard: RankShard, cores: tuple[int, ...], log_level: int = logging.INFO,
                 stage: Stage | None = None) -> None:
        """`stage`: the pipeline stage whose layers it holds (None: every layer)."""
        self.shard, self.cores, self.stage = shard, cores, stage
        logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s {self.name} %(name)s: %(message)s")
        self.stage_store: StageLayers | None = None  # where its forward's stage input and output pass
        self._pinned_threads: set[int] = set()
        self._pin_this_thread()
        self.collectives = None
        self.runner: ModelRunner | None = None
        self.weight_stats: WeightStats | None = None  # what this rank's layer store writes (given to build)

    @property
    def name(self) -> str:
        return worker_name(self.shard.rank, None if self.stage is None else self.stage.index)

    def _pin_this_thread(self) -> None:
        """Keep the calling thread to this rank's cores: Ray runs an actor's calls on threads of its
        own (a compiled graph's loop among them), which do not inherit the constructor's mask."""
        thread = threading.get_ident()
        if not self.cores or thread in self._pinned_threads or not hasattr(os, "sched_setaffinity"):
            return
        os.sched_setaffinity(0, set(self.cores))
        torch.set_num_threads(len(self.cores))
        self._pinned_threads.add(thread)

    def rendezvous_address(self) -> str:
        """tcp://<this node>:<a free port> for the process group (asked of rank 0)."""
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        return f"tcp://{_node_ip()}:{port}"

    def connect(self, init_method: str | None, device: str, segment_name: str | None) -> None:
        """Join the other ranks: in the shared-memory segment `segment_name`, else at `init_method`,
        reachable from the other nodes at this node's address in the cluster."""
        node_ip = None if segment_name is not None else _node_ip()
        self.collectives = create_collectives(self.shard.rank, self.shard.world_size, device, init_method,
                                              segment_name, node_ip)

    def build(self, source: ModelSource, device: str, runner_kwargs: dict,
              vocab_ranges: list[tuple[int, int]]) -> RankReport:
        """This rank's runner over its shard of its stage's layers; `runner_kwargs["layer_store"]`
        makes the store its layers are placed by (None: every layer resident), under the
        row-parallel and stage wrappings, and `runner_kwargs["weight_stats"]` is what that store
        writes to."""
        self._pin_this_thread()
        loader = create_loader(source.model, source.load_format, seed=source.seed)
        if self.stage is not None:
            loader = StageLoader(loader, self.stage)
        if self.shard.world_size > 1:
            loader = ShardedLoader(loader, self.shard)
        cores = self._core_assignment(device)
        inner_store = runner_kwargs.pop("layer_store")
        self.weight_stats = runner_kwargs.pop("weight_stats")  # the very object the store holds: one pickle

        def layer_store(gpu_device: torch.device, rank_cores: CoreAssignment) -> LayerStore:
            store = inner_store(gpu_device, rank_cores) if inner_store is not None else \
                resident_store(loader.config, gpu_device)
            if self.shard.world_size > 1:
                store = TensorParallelLayers(store, self.collectives, vocab_ranges)
            if self.stage is not None:
                store = self.stage_store = StageLayers(store, self.stage)
            return store

        self.runner = ModelRunner(loader.config, loader, device=_local_device(device), cores=cores,
                                  layer_store=layer_store, **runner_kwargs)
        logger.info("rank %d of %d: KV heads %s, MLP units %s, LM-head rows %s, layers %s, cores %s",
                    self.shard.rank, self.shard.world_size, self.shard.kv_heads, self.shard.intermediate,
                    self.shard.vocab, self.stage.layers if self.stage else "all", sorted(self.cores))
        return RankReport(self.shard.rank, os.getpid(), _actor_id(), cores, self.runner.num_gpu_blocks,
                          self.runner.weight_bytes(), None if self.stage is None else self.stage.index)

    def _core_assignment(self, device: str) -> CoreAssignment:
        return CoreAssignment.for_rank(_local_device(device), self.cores)

    def execute(self, plan: IterationPlan, incoming=None):
        """The plan's forward on this rank. The rank that samples (rank 0 of the last stage) returns
        the tokens, with what its layer store did so far; an earlier stage's rank 0 its output
        for the next stage (`incoming` at that one); the others None. A failure comes back as a
        value, so that the driver can tell one rank's from every rank's, and later stages pass an
        earlier one's on."""
        self._pin_this_thread()
        if isinstance(incoming, RankFailure):
            return incoming
        try:
            if self.stage_store is not None:
                self.stage_store.incoming = incoming
            if self.shard.rank != 0:  # its stage's output, the same on every rank, goes on from rank 0
                self.runner.forward(plan)
                if self.stage_store is not None:
                    self.stage_store.outgoing = None
                return None
            if self.stage is None or self.stage.last:
                return self.runner.execute(plan), self.weight_stats.snapshot()
            self.runner.forward(plan)
            outgoing, self.stage_store.outgoing = self.stage_store.outgoing, None
            return outgoing
        except Exception as exc:
            logger.exception("%s: the step failed", self.name)
            return RankFailure(self.shard.rank, f"{type(exc).__name__}: {exc}", _picklable(exc))

    def profile_costs(self, profile_kwargs: dict) -> TableCostModel:
        """The cost tables as this rank measures them, its own store's stalls set apart."""
        self._pin_this_thread()
        return self.runner.profile_costs(**dict(profile_kwargs, weight_stats=self.weight_stats))

    def begin_serving(self) -> None:
        self.runner.begin_serving()

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
        if self.collectives is not None:
            self.collectives.close()


def resident_store(config: ModelConfig, device: torch.device) -> LayerStore:
    """Every layer resident, as the model builds it without a store."""
    return ResidentMoeLayers(device) if config.is_moe else LayerStore(device)


def _actor_id() -> str:
    import ray

    return ray.get_runtime_context().get_actor_id()


def _node_ip() -> str:
    """This node's address in the Ray cluster (what the other nodes reach it at)."""
    import ray

    return ray.util.get_node_ip_address()


def _local_device(device: str) -> str:
    """The device as this process sees it: Ray gives each GPU rank one visible device."""
    return "cuda" if device.startswith("cuda") else device
