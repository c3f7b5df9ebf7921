"""One data-parallel replica: a Ray actor holding a whole engine (its own KV pools, prefix cache
and metrics) on its own cores, serving the requests the front end routes to it as streams."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import AsyncIterator

from engine.async_engine import QueueBounds, RequestStream
from engine.config import EngineConfig
from engine.outputs import RequestOutput
from scheduler.sampling_params import SamplingParams
from server.replicas.local import serving_engine


class RequestAbortedError(RuntimeError):
    """Ends an aborted request's generate on the replica (the front end stopped reading it)."""


@dataclass(frozen=True)
class ReplicaInfo:
    """What a started replica tells the front end."""

    index: int
    pid: int
    node_ip: str
    cores: tuple[int, ...]
    max_model_len: int
    dtype: str  # the compute dtype it chose
    num_cached_blocks: int  # blocks its prefix cache can hold at most (both pools)
    block_size: int
    eos_token_ids: tuple[int, ...]  # the tokenizer's and the model's, as its engine stops on them


class ReplicaWorker:
    """Replica `index`: its engine's loop runs on a thread of this actor's process, and each
    `generate` call streams one request's outputs back as they come."""

    def __init__(self, index: int, config: EngineConfig, model_name: str, cores: tuple[int, ...],
                 bounds: QueueBounds, log_level: int = logging.INFO) -> None:
        logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s replica {index} %(name)s: %(message)s")
        if cores and hasattr(os, "sched_setaffinity"):  # before the engine plans its threads from them
            os.sched_setaffinity(0, set(cores))
        self.index, self.cores = index, cores
        self.async_engine, self.metrics = serving_engine(config, model_name, bounds)
        self.async_engine.start()
        self._streams: dict[str, RequestStream] = {}  # each request's, while its generate runs

    def info(self) -> ReplicaInfo:
        import ray

        engine = self.async_engine.engine
        pool = engine.scheduler.block_pool
        return ReplicaInfo(self.index, os.getpid(), ray.util.get_node_ip_address(), self.cores, engine.max_model_len,
                           str(engine.dtype).removeprefix("torch."), pool.num_blocks + engine.plan.num_cpu_blocks,
                           engine.config.cache.block_size, engine.eos_token_ids)

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """The request's outputs; an abort (or the caller going away) frees its blocks."""
        prepared = self.async_engine.prepare(prompt_token_ids, params)
        stream = self._streams[request_id] = self.async_engine.add_request(request_id, prepared)
        try:
            async for output in stream:
                yield output
        finally:
            self._streams.pop(request_id, None)
            if not stream.finished:
                self.async_engine.abort(request_id)

    async def abort(self, request_id: str) -> None:
        """Free the request's blocks and end its generate (the engine sends an aborted request
        nothing more; on the event loop, where its stream is read)."""
        self.async_engine.abort(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.put(RequestAbortedError(f"request {request_id} was aborted"))

    def dead_reason(self) -> str | None:
        return None if self.async_engine.is_running else (self.async_engine.dead_reason or "its engine stopped")

    def metrics_text(self) -> bytes:
        return self.metrics.render()

    def shutdown(self) -> None:
        self.async_engine.shutdown()
