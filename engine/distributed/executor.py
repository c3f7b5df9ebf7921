"""The driver's side of tensor and pipeline parallelism: one RankWorker per rank (and per
pipeline stage) as a Ray actor.

The scheduler stays here; each iteration's plan goes to every rank at once (a compiled Ray graph's
shared-memory channels). Tensor-parallel ranks run the same forward with their shards and rank 0's
sampled tokens come back; pipeline stages run one after another, each handing its hidden states
to the next, and the last stage's tokens come back. A rank that dies (its process killed, its node
lost) or fails alone ends the engine with `RankLostError`: the others would wait in their next
collective (or for the stage before them) forever. A stage's failure on its own is the plan's:
the stages after it pass it on, and none is left out of step."""
from __future__ import annotations

import logging
import re
import time
import uuid
from multiprocessing import shared_memory

from engine.distributed.partition import plan_shards
from engine.distributed.stages import plan_stages
from engine.distributed.wire import wire_plan
from engine.distributed.worker import ModelSource, RankFailure, RankReport, RankWorker, worker_name
from engine.device.cores import CoreAssignment, device_kind, host_cores, rank_core_sets
from engine.runtime.runner import FatalRunnerError, RunnerOutput
from engine.offload.stats import WeightStats
from engine.model_config import ConfigError, ModelConfig
from scheduler.planning.cost_model import TableCostModel
from scheduler.iteration_plan import IterationPlan

logger = logging.getLogger(__name__)

# After one rank fails, how long the others get to fail alike (the same bad plan on every rank)
# before the failure counts as that rank's alone.
PEER_FAILURE_WAIT_S = 30.0
CLOSE_TIMEOUT_S = 10.0  # a rank's own close (its threads, its process group)


class RankLostError(FatalRunnerError):
    """A tensor-parallel rank died or failed alone: the ranks are out of step and cannot go on."""


class TensorParallelRunner:
    """ModelRunner's interface to the engine, over `world_size` ranks."""

    def __init__(self, model_config: ModelConfig, source: ModelSource, device: str, world_size: int,
                 ray_address: str | None, runner_kwargs: dict, weight_stats: WeightStats, num_stages: int = 1,
                 layer_stores: list | None = None) -> None:
        """`world_size` tensor-parallel ranks in each of `num_stages` pipeline stages (one stage:
        no pipeline). `runner_kwargs`: ModelRunner's; `layer_stores`: per stage, a factory of the
        store each rank of it places its shard's layers by (None: resident); `weight_stats`: where
        the sampling rank's store's totals land after each step."""
        import ray

        self._ray, self._lost, self._step_graph, self._segments = ray, False, None, []
        self.world_size, self.vocab_size, self.weight_stats = world_size, model_config.vocab_size, weight_stats
        shards = plan_shards(model_config, world_size)
        self.stages = plan_stages(model_config, num_stages) if num_stages > 1 else None
        flags = f"--tensor-parallel-size {world_size}" + (f" --pipeline-parallel-size {num_stages}" if num_stages > 1 else "")
        self._started_ray = start_ray(ray, ray_address, world_size * num_stages, device_kind(device) == "cuda", flags)
        one_host = ray_address is None
        self._workers = self._start_workers(ray, shards, self.stages or [None], device, pin_cores=one_host)
        try:
            if world_size > 1:
                self._connect(ray, device, one_host)
            vocab_ranges = [shard.vocab for shard in shards]
            stores = layer_stores or [None] * num_stages
            self.reports: list[RankReport] = self._gather([worker.build.remote(
                source, device, dict(runner_kwargs, weight_stats=weight_stats, layer_store=stores[index // world_size]),
                vocab_ranges) for index, worker in enumerate(self._workers)])
        except BaseException:
            self.close()
            raise
        for report in self.reports:
            logger.info("%s: pid %d, %d GPU KV blocks", report.name, report.pid, report.num_gpu_blocks)

    def _connect(self, ray, device: str, one_host: bool) -> None:
        """Each stage's tensor-parallel ranks' collectives, a group of their own: CPU ranks of one
        host meet in shared memory, GPUs and hosts over torch.distributed."""
        shared = one_host and device_kind(device) != "cuda"
        calls = []
        for group in self._stage_groups():
            segment = f"tandem-tp-{uuid.uuid4().hex[:16]}" if shared else None
            address = None if shared else ray.get(group[0].rendezvous_address.remote())
            self._segments += [segment] if segment else []
            calls += [worker.connect.remote(address, device, segment) for worker in group]
            logger.info("tensor-parallel collectives: %s", f"shared memory {segment}" if shared
                        else f"torch.distributed at {address}")
        self._gather(calls)

    def _stage_groups(self) -> list[list]:
        """The workers of each stage (one stage without a pipeline), in rank order."""
        return [self._workers[start:start + self.world_size] for start in range(0, len(self._workers), self.world_size)]

    @staticmethod
    def _start_workers(ray, shards, stages, device: str, pin_cores: bool) -> list:
        """One actor per rank of each stage; on a local cluster each pinned to its own run of this
        host's cores."""
        kind = device_kind(device)
        placed = [(shard, stage) for stage in stages for shard in shards]
        core_sets = rank_core_sets(host_cores(), len(placed)) if pin_cores else [()] * len(placed)
        actor = ray.remote(RankWorker)
        workers = []
        for (shard, stage), cores in zip(placed, core_sets):
            options = dict(num_cpus=max(1, len(cores)), num_gpus=1 if kind == "cuda" else 0)
            workers.append(actor.options(**options).remote(shard, cores, logging.getLogger().getEffectiveLevel(),
                                                            stage))
        return workers

    # ---- what the engine asks of a runner ------------------------------------------------------
    @property
    def cores(self) -> CoreAssignment:
        return self.reports[0].cores

    @property
    def num_gpu_blocks(self) -> int:
        """Blocks every rank's GPU pool holds (each rank stores its own heads of the same blocks)."""
        return min(report.num_gpu_blocks for report in self.reports)

    def weight_bytes(self) -> dict[tuple[str, str], int]:
        """Summed over the ranks (the embeddings counted once per rank: each holds them whole)."""
        totals: dict[tuple[str, str], int] = {}
        for report in self.reports:
            for key, nbytes in report.weight_bytes.items():
                totals[key] = totals.get(key, 0) + nbytes
        return totals

    def execute(self, plan: IterationPlan) -> RunnerOutput:
        """The plan on every rank; the sampling rank's tokens (and its store's totals into weight_stats)."""
        results = self._run_step(wire_plan(plan, self.vocab_size))
        failures = [result for result in results if isinstance(result, RankFailure)]
        if failures and self.stages is not None:
            raise failures[0].error  # a stage's alone: the ones after it passed it on, none is out of step
        if failures:
            self._raise_failures(failures)
        output, rank_stats = results[0]
        self.weight_stats.copy_from(rank_stats)
        return output

    def _run_step(self, plan: IterationPlan) -> list:
        """Every rank's result of `plan` (the last stage's, with stages), through a compiled Ray
        graph: the plan reaches the ranks over shared-memory channels (0.5 ms a step on the 2-core
        VM where an actor call per rank and the object store took 4-6), and a stage's output the
        next stage the same way."""
        ray = self._ray
        if self._step_graph is None:
            self._step_graph = self._compile_step_graph()
        try:
            return [ref.get(timeout=-1) for ref in self._step_graph.execute(plan)]  # -1: a prefill may take long
        except (ray.exceptions.RayActorError, ray.exceptions.RayChannelError) as exc:
            self._lost = True
            raise RankLostError(f"{self._rank_of(exc)} died: {first_line(exc)}") from exc

    def _compile_step_graph(self):
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as step_plan:
            incoming, others = None, []
            for group in self._stage_groups():  # every rank of a stage reads its predecessor's rank 0
                nodes = [w.execute.bind(step_plan) if incoming is None else w.execute.bind(step_plan, incoming)
                         for w in group]
                incoming, others = nodes[0], others + nodes[1:]
            return MultiOutputNode([incoming, *others]).experimental_compile()

    def _raise_failures(self, failures: list[RankFailure]) -> None:
        """The same error on every rank is the plan's (the engine fails the batch and goes on);
        another is a rank's alone, and the ranks are out of step."""
        num_workers = self.world_size * len(self.stages or [None])
        if len(failures) == num_workers and len({failure.message for failure in failures}) == 1:
            raise failures[0].error
        self._lost = True
        failure = failures[0]
        raise RankLostError(f"{self._name(failure.rank)} failed alone: {failure.message}")

    def _name(self, index: int) -> str:
        """The worker at `index` as errors name it (RankReport.name)."""
        stage, rank = divmod(index, self.world_size)
        return worker_name(rank, None if self.stages is None else stage)

    def _rank_of(self, exc: BaseException) -> str:
        """The dead worker's name where Ray's error names it: by its actor id (a lost node's actors
        are unavailable, not dead, and only their id is known) or its pid; else "a rank"."""
        text, pid = str(exc), re.search(r"pid: (\d+)", str(exc))
        named = [report.name for report in getattr(self, "reports", [])
                 if report.actor_id == getattr(exc, "actor_id", None) or report.actor_id in text
                 or (pid and report.pid == int(pid[1]))]
        return named[0] if named else "a rank"

    def profile_costs(self, **profile_kwargs) -> TableCostModel:
        """Every rank profiles in lock-step (the linear stages and the head are collectives); rank
        0's tables, which wait for the slowest rank at every collective, are the engine's."""
        return self._gather([worker.profile_costs.remote(profile_kwargs) for worker in self._workers])[0]

    def begin_serving(self) -> None:
        self._gather([worker.begin_serving.remote() for worker in self._workers])

    def close(self) -> None:
        """Stop every rank: gracefully, or after a loss (the others may be stuck in a collective,
        and the step graph's loop with them) by killing them first."""
        workers, self._workers = getattr(self, "_workers", []), []
        if self._lost:
            self._kill(workers)
            self._teardown_step_graph()
        else:
            self._teardown_step_graph()
            for worker in workers:
                try:
                    self._ray.get(worker.close.remote(), timeout=CLOSE_TIMEOUT_S)
                except Exception:  # a rank that failed to build has nothing left to close
                    logger.debug("tensor-parallel rank: close failed", exc_info=True)
            self._kill(workers)
        for segment in getattr(self, "_segments", []):
            remove_segment(segment)
        if self._started_ray and self._ray.is_initialized():
            self._ray.shutdown()

    def _kill(self, workers: list) -> None:
        for worker in workers:
            self._ray.kill(worker)

    def _teardown_step_graph(self) -> None:
        if self._step_graph is None:
            return
        try:
            self._step_graph.teardown(kill_actors=self._lost)
        except Exception:  # a graph whose rank died may be torn down already
            logger.debug("tensor-parallel step graph: teardown failed", exc_info=True)
        self._step_graph = None

    # ---- results ------------------------------------------------------------------------------
    def _gather(self, refs: list) -> list:
        """Every rank's result in rank order. A dead rank raises RankLostError as soon as Ray
        knows; an exception on every rank is the plan's and is raised as it is; one on some ranks
        only leaves the others stuck in a collective, and is a lost rank too."""
        ray = self._ray
        ranks = {ref: rank for rank, ref in enumerate(refs)}
        results, failures, pending = {}, {}, list(refs)
        deadline = None
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not ready:
                break
            ref = ready[0]
            try:
                results[ranks[ref]] = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                self._lost = True
                raise RankLostError(f"{self._name(ranks[ref])} died: {first_line(exc)}") from exc
            except ray.exceptions.RayTaskError as exc:
                cause = exc.cause if isinstance(exc.cause, BaseException) else exc
                failures[ranks[ref]] = RankFailure(ranks[ref], f"{type(cause).__name__}: {cause}", cause)
                deadline = deadline or time.monotonic() + PEER_FAILURE_WAIT_S
        if failures:
            self._raise_failures([failures[rank] for rank in sorted(failures)])
        return [results[rank] for rank in range(len(refs))]


def remove_segment(name: str | None) -> None:
    """The ranks' shared-memory segment, where a killed rank 0 left it behind."""
    if name is None:
        return
    try:
        segment = shared_memory.SharedMemory(name=name)
    except FileNotFoundError:
        return
    segment.close()
    segment.unlink()


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def require_resources(ray, num_actors: int, one_gpu_each: bool, flags: str) -> None:
    """ConfigError naming `flags` where the Ray cluster cannot place `num_actors` actors of a CPU
    (and a GPU) each: Ray would wait for them forever."""
    resources = ray.cluster_resources()
    needs = {"CPU": num_actors, "GPU": num_actors if one_gpu_each else 0}
    short = [f"{need} {kind}s (the Ray cluster has {int(resources.get(kind, 0))})" for kind, need in needs.items()
             if resources.get(kind, 0) < need]
    if short:
        raise ConfigError(f"{flags} needs {', '.join(short)}")


def start_ray(ray, address: str | None, num_actors: int, one_gpu_each: bool, flags: str) -> bool:
    """Join the cluster at `address`, or start a local one with a CPU slot per actor at least,
    unless this process is in one already; then refuse (require_resources) what it cannot place,
    shutting down what was started here. Whether Ray was started here."""
    started = not ray.is_initialized()
    if started and address:
        ray.init(address=address, include_dashboard=False, configure_logging=False)
    elif started:
        ray.init(num_cpus=max(len(host_cores()), num_actors), include_dashboard=False, configure_logging=False)
    try:
        require_resources(ray, num_actors, one_gpu_each, flags)
    except ConfigError:
        if started:
            ray.shutdown()
        raise
    return started
