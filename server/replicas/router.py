"""The front end of `--data-parallel-size N`: N replicas (server/replicas/worker.py), each request
sent to one of them. `ReplicaSet` offers the server what an `AsyncEngine` does (prepare, add a
request and get its stream, abort, health), so the routes are the same with one engine or many.

Routing (`--data-parallel-routing`): `prefix` sends a prompt to the live replica that was sent the
longest run of its leading blocks (so a conversation's turns find their history in that replica's
prefix cache), the least loaded among equals; `round-robin` takes them in turn. A replica that dies
leaves the rotation: its requests in flight fail with EngineDeadError (503), the others go on; the
server is dead only when every replica is.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from engine.async_engine import EngineDeadError, QueueBounds, QueueFullError, RequestStream
from engine.config import EngineConfig
from engine.device.cores import device_kind, host_cores, rank_core_sets
from engine.distributed.executor import first_line, start_ray
from engine.engine import RequestFailedError
from engine.model_config import ConfigError
from engine.request import InputProcessor, PreparedRequest
from engine.text import Tokenizer
from engine.weights import create_loader
from scheduler.prefix_cache import chain_hash, root_hash
from server.replicas import ROUTINGS
from server.replicas.metrics import ReplicaMetrics
from server.replicas.worker import ReplicaInfo, ReplicaWorker

logger = logging.getLogger(__name__)

ROUTE_BLOCK_TOKENS = 16  # the prompt's blocks as the router hashes them (the engine's default block)
# A replica holding a prompt's prefix is passed over when it has more requests in flight than the
# least loaded one plus 1 and a quarter of that one's load: otherwise every conversation sharing a
# system prompt would follow the first one there and leave the other replicas idle.
LOAD_GAP_SHARE = 0.25
ROUTE_ROOT = root_hash("tandem-router")  # the chain's start (every replica serves the same model)
HEALTH_INTERVAL_S = 2.0  # how often idle replicas are checked for life
HEALTH_TIMEOUT_S = 10.0
SHUTDOWN_TIMEOUT_S = 10.0


def block_hashes(token_ids: Sequence[int], block_tokens: int = ROUTE_BLOCK_TOKENS) -> list[bytes]:
    """Chained digests of the prompt's whole blocks, as the prefix cache chains them: equal
    digests mean equal prefixes."""
    digests, previous = [], ROUTE_ROOT
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        previous = chain_hash(previous, list(token_ids[start:start + block_tokens]))
        digests.append(previous)
    return digests


class PrefixIndex:
    """The prompt blocks sent to one replica, least recently sent forgotten first beyond what its
    prefix cache can hold."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = max(1, capacity_blocks)
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def matched_blocks(self, hashes: Sequence[bytes]) -> int:
        for count, digest in enumerate(hashes):
            if digest not in self._blocks:
                return count
        return len(hashes)

    def add(self, hashes: Sequence[bytes]) -> None:
        for digest in hashes:
            self._blocks[digest] = None
            self._blocks.move_to_end(digest)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)


@dataclass(eq=False)
class Replica:
    """The front end's view of one replica."""

    info: ReplicaInfo
    actor: object  # the Ray actor handle
    prefixes: PrefixIndex
    num_in_flight: int = 0
    last_routed: int = -1  # the routing's count when it last chose this replica
    waiting: dict[str, int] = field(default_factory=dict)  # prompt tokens of requests without output yet
    dead_reason: str | None = None

    @property
    def name(self) -> str:
        return f"data-parallel replica {self.info.index} (pid {self.info.pid} on {self.info.node_ip})"


class Routing(Protocol):
    def choose(self, hashes: Sequence[bytes], live: list[Replica]) -> Replica: ...


def max_load(least: int) -> int:
    """The most requests in flight a replica may have to be chosen for its prefix."""
    return least + 1 + int(LOAD_GAP_SHARE * least)


class PrefixRouting:
    """Among the replicas not much busier than the least loaded: the longest prefix sent before,
    then the fewest requests in flight, then the one chosen least recently (so idle replicas take
    prompts nobody holds in turn)."""

    def __init__(self) -> None:
        self._count = itertools.count()

    def choose(self, hashes: Sequence[bytes], live: list[Replica]) -> Replica:
        bound = max_load(min(r.num_in_flight for r in live))
        candidates = [r for r in live if r.num_in_flight <= bound]
        best = max(candidates, key=lambda r: (r.prefixes.matched_blocks(hashes), -r.num_in_flight, -r.last_routed))
        best.last_routed = next(self._count)
        return best


class RoundRobinRouting:
    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, hashes: Sequence[bytes], live: list[Replica]) -> Replica:
        return live[next(self._turn) % len(live)]


ROUTING_TYPES: dict[str, Callable[[], Routing]] = {"prefix": PrefixRouting, "round-robin": RoundRobinRouting}


def create_routing(name: str) -> Routing:
    if name not in ROUTING_TYPES:
        raise ConfigError(f"--data-parallel-routing must be one of {', '.join(ROUTINGS)}, got {name!r}")
    return ROUTING_TYPES[name]()


class FrontEngine:
    """What the routes read of "the engine" with replicas: the model's config, its tokenizer and
    the same checks a replica makes before queuing a request."""

    def __init__(self, config: EngineConfig, infos: list[ReplicaInfo]) -> None:
        loader = create_loader(config.model, config.load_format, seed=config.seed)
        self.config, self.model_config = config, loader.config
        self.tokenizer = Tokenizer.from_source(loader.tokenizer_source) if loader.tokenizer_source else None
        self.max_model_len = min(info.max_model_len for info in infos)
        self.dtype = infos[0].dtype
        self.inputs = InputProcessor(self.tokenizer, self.model_config.vocab_size, self.max_model_len,
                                     infos[0].eos_token_ids)

    def prepare_request(self, prompt, params) -> PreparedRequest:
        return self.inputs.prepare(prompt, params)


class ReplicaSet:
    """The replicas behind the server, used as the server uses an AsyncEngine."""

    def __init__(self, replicas: list[Replica], front: FrontEngine, routing: Routing, bounds: QueueBounds,
                 on_dead: Callable[[str], None] | None = None, started_ray: bool = False) -> None:
        import ray

        self._ray, self.replicas, self.engine, self.routing, self.bounds = ray, replicas, front, routing, bounds
        self._on_dead, self._started_ray = on_dead, started_ray
        self._requests: dict[str, tuple[Replica, asyncio.Task, asyncio.AbstractEventLoop]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._watch_health, name="tandem-replica-health", daemon=True)

    # ---- what the server calls ------------------------------------------------------------------
    def start(self) -> None:
        self._watch.start()

    @property
    def live(self) -> list[Replica]:
        return [replica for replica in self.replicas if replica.dead_reason is None]

    @property
    def is_running(self) -> bool:
        """As an AsyncEngine's: not before start() (the server's lifespan starts what is not running)."""
        return self._watch.is_alive() and bool(self.live)

    @property
    def dead_reason(self) -> str | None:
        if self.live:
            return None
        return "every data-parallel replica is lost: " + "; ".join(r.dead_reason or "" for r in self.replicas)

    def prepare(self, prompt, params) -> PreparedRequest:
        return self.engine.prepare_request(prompt, params)

    def add_request(self, request_id: str, prepared: PreparedRequest) -> RequestStream:
        live = self.live
        if not live:
            raise EngineDeadError(self.dead_reason)
        hashes = block_hashes(prepared.prompt_token_ids)
        replica = self.routing.choose(hashes, live)
        self._admit(replica, len(prepared.prompt_token_ids))
        stream = RequestStream(request_id, prepared.params.n)
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._relay(replica, request_id, prepared, stream))
        with self._lock:
            self._requests[request_id] = (replica, task, loop)
            replica.waiting[request_id] = len(prepared.prompt_token_ids)
            replica.num_in_flight += 1
        replica.prefixes.add(hashes)
        return stream

    def abort(self, request_id: str) -> None:
        """From any thread: the relay stops and the replica frees the request's blocks."""
        with self._lock:
            entry = self._requests.get(request_id)
        if entry is None:
            return
        replica, task, loop = entry
        replica.actor.abort.remote(request_id)
        try:
            loop.call_soon_threadsafe(task.cancel)
        except RuntimeError:  # the loop has closed: nothing relays any more
            pass

    def shutdown(self, timeout: float = SHUTDOWN_TIMEOUT_S) -> None:
        self._stop.set()
        refs = [replica.actor.shutdown.remote() for replica in self.live]
        if refs:
            self._ray.wait(refs, num_returns=len(refs), timeout=timeout)
        for replica in self.replicas:
            self._ray.kill(replica.actor)
        if self._started_ray and self._ray.is_initialized():
            self._ray.shutdown()

    def metrics_texts(self) -> list[tuple[int, bytes]]:
        """Each live replica's /metrics exposition, by replica index."""
        live = self.live
        refs = [replica.actor.metrics_text.remote() for replica in live]
        texts = []
        for replica, ref in zip(live, refs):
            try:
                texts.append((replica.info.index, self._ray.get(ref, timeout=HEALTH_TIMEOUT_S)))
            except Exception as exc:  # a replica that cannot answer is checked by the watcher
                logger.warning("%s: no metrics (%s)", replica.name, exc)
        return texts

    # ---- relaying one request ---------------------------------------------------------------------
    def _admit(self, replica: Replica, num_tokens: int) -> None:
        """The queue bounds, per replica: 429 rather than a queue no one can drain soon."""
        bounds = self.bounds
        with self._lock:
            if len(replica.waiting) >= bounds.max_waiting_requests:
                raise QueueFullError(f"{len(replica.waiting)} requests are already waiting for {replica.name} "
                                     f"(limit {bounds.max_waiting_requests})", bounds.retry_after_s)
            waiting_tokens = sum(replica.waiting.values())
            if replica.waiting and waiting_tokens + num_tokens > bounds.max_waiting_tokens:
                raise QueueFullError(f"{waiting_tokens} prompt tokens are already waiting for {replica.name} "
                                     f"(limit {bounds.max_waiting_tokens})", bounds.retry_after_s)

    async def _relay(self, replica: Replica, request_id: str, prepared: PreparedRequest,
                     stream: RequestStream) -> None:
        outputs = replica.actor.generate.options(num_returns="streaming").remote(
            request_id, prepared.prompt_token_ids, prepared.params)
        try:
            async for ref in outputs:
                output = await ref
                replica.waiting.pop(request_id, None)
                stream.put(output)
        except asyncio.CancelledError:
            pass  # by abort(), which has told the replica
        except self._ray.exceptions.RayActorError as exc:
            stream.put(EngineDeadError(self._lose(replica, f"its actor died: {first_line(exc)}")))
        except self._ray.exceptions.RayTaskError as exc:
            stream.put(self._request_error(replica, exc))
        except Exception as exc:  # the relay itself broke: this request fails, the replica goes on
            logger.exception("%s: relaying %s failed", replica.name, request_id)
            stream.put(RequestFailedError(f"internal error relaying to {replica.name}: {exc!r}"))
        finally:
            with self._lock:
                self._requests.pop(request_id, None)
                replica.waiting.pop(request_id, None)
                replica.num_in_flight -= 1

    def _request_error(self, replica: Replica, exc) -> BaseException:
        """The replica's own error for this request, as the server would have had it in-process."""
        cause = getattr(exc, "cause", None)
        if isinstance(cause, EngineDeadError):
            return EngineDeadError(self._lose(replica, str(cause)))
        if isinstance(cause, (RequestFailedError, QueueFullError)):
            return cause
        return RequestFailedError(f"{replica.name}: {first_line(cause or exc)}")

    def _lose(self, replica: Replica, why: str) -> str:
        """Take `replica` out of the rotation; once none is left the server is dead."""
        reason = f"{replica.name} is lost: {why}"
        with self._lock:
            first = replica.dead_reason is None
            if first:
                replica.dead_reason = reason
        if first:
            logger.error("%s; %d replica(s) go on", reason, len(self.live))
            if not self.live and self._on_dead is not None:
                self._on_dead(self.dead_reason)
        return replica.dead_reason

    def _watch_health(self) -> None:
        """Notice a replica that dies while no request is relayed to it."""
        while not self._stop.wait(HEALTH_INTERVAL_S):
            for replica in self.live:
                try:
                    why = self._ray.get(replica.actor.dead_reason.remote(), timeout=HEALTH_TIMEOUT_S)
                except self._ray.exceptions.RayActorError as exc:
                    why = f"its actor died: {first_line(exc)}"
                except self._ray.exceptions.GetTimeoutError:
                    continue  # busy, not dead
                if why is not None and not self._stop.is_set():
                    self._lose(replica, why)


def replica_set(config: EngineConfig, model_name: str, bounds: QueueBounds, num_replicas: int, routing: str,
                on_dead: Callable[[str], None] | None = None) -> tuple[ReplicaSet, ReplicaMetrics]:
    """`num_replicas` replicas of the engine `config` describes, started on Ray (the cluster at
    --ray-address, or a local one whose cores are cut between them), and their front end."""
    import ray

    parallel = config.parallel
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ConfigError(f"--data-parallel-size must be an integer >= 1, got {num_replicas!r}")
    if parallel.enabled:
        raise ConfigError(f"--data-parallel-size {num_replicas} does not combine with --tensor-parallel-size or "
                          "--pipeline-parallel-size yet: use one of them")
    chosen = create_routing(routing)
    num_gpus = 1 if device_kind(config.device) == "cuda" else 0
    started_ray = start_ray(ray, parallel.ray_address, num_replicas, num_gpus == 1,
                            f"--data-parallel-size {num_replicas}")
    one_host = parallel.ray_address is None
    core_sets = rank_core_sets(host_cores(), num_replicas) if one_host else [()] * num_replicas
    actor = ray.remote(ReplicaWorker)
    actors = [actor.options(num_cpus=max(1, len(cores)), num_gpus=num_gpus).remote(
        index, config, model_name, cores, _replica_bounds(bounds), logging.getLogger().getEffectiveLevel())
        for index, cores in enumerate(core_sets)]
    try:
        infos = ray.get([a.info.remote() for a in actors])
    except BaseException:
        for a in actors:
            ray.kill(a)
        if started_ray:
            ray.shutdown()
        raise
    replicas = [Replica(info, a, PrefixIndex(info.num_cached_blocks * info.block_size // ROUTE_BLOCK_TOKENS))
                for info, a in zip(infos, actors)]
    for info in infos:
        logger.info("data-parallel replica %d: pid %d on %s, cores %s, max_model_len %d", info.index, info.pid,
                    info.node_ip, list(info.cores) or "its node's", info.max_model_len)
    replicas_set = ReplicaSet(replicas, FrontEngine(config, infos), chosen, bounds, on_dead, started_ray)
    return replicas_set, ReplicaMetrics(model_name, replicas_set.metrics_texts)


def _replica_bounds(bounds: QueueBounds) -> QueueBounds:
    """The front end holds the bounds; a replica takes whatever it is sent."""
    return QueueBounds(max_waiting_requests=2**31 - 1, max_waiting_tokens=2**62, retry_after_s=bounds.retry_after_s)
