"""What the routes share: the server's settings and the one ServerContext per app, which
create_app stores on app.state and routes receive through the `Context` dependency."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from engine.async_engine import AsyncEngine
from engine.engine import LLMEngine
from engine.text import Tokenizer
from server.metrics import Metrics


@dataclass(frozen=True)
class ServerSettings:
    """The server's own flags (the engine's are EngineConfig's)."""
    served_model_name: str
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 4 * 2**20
    cors_origins: tuple[str, ...] = ()
    tool_call_parser: str = "auto"  # the format tool calls are read in; auto: the chat template's


@dataclass(frozen=True)
class ServerContext:
    """Everything a route needs besides its request."""
    async_engine: AsyncEngine
    tokenizer: Tokenizer | None  # None for dummy weights: prompts must then be token ids
    model_name: str  # the name clients send and see
    settings: ServerSettings
    metrics: Metrics

    @classmethod
    def build(cls, async_engine: AsyncEngine, settings: ServerSettings, metrics: Metrics) -> ServerContext:
        return cls(async_engine, async_engine.engine.tokenizer, settings.served_model_name, settings, metrics)

    @property
    def engine(self) -> LLMEngine:
        return self.async_engine.engine


async def server_context(request: Request) -> ServerContext:
    """The app's ServerContext. (Async, so FastAPI calls it inline instead of in a worker thread.)"""
    return request.app.state.context


Context = Annotated[ServerContext, Depends(server_context)]
