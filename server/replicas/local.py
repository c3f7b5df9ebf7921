"""One engine with its metrics, its loop on a thread of this process: what `tandem serve` runs,
and what each data-parallel replica runs in its own."""
from __future__ import annotations

from typing import Callable

from engine.async_engine import AsyncEngine, QueueBounds
from engine.config import EngineConfig
from engine.engine import LLMEngine
from server.metrics import Metrics


def serving_engine(config: EngineConfig, model_name: str, bounds: QueueBounds,
                   on_dead: Callable[[str], None] | None = None) -> tuple[AsyncEngine, Metrics]:
    """The engine built from `config`, wrapped for async serving, its metrics recorded as it runs."""
    engine = LLMEngine(config)
    metrics = Metrics(model_name)
    metrics.record_weights(engine.runner.weight_bytes())
    metrics.record_kv_format(engine.kv_format.name, engine.kv_bytes_per_token)
    metrics.record_threads(engine.thread_plan.split)
    metrics.watch_experts(engine.expert_heat)
    async_engine = AsyncEngine(engine, bounds, on_iteration=metrics.record_iteration, on_abort=metrics.record_abort,
                               on_dead=on_dead)
    return async_engine, metrics
