"""The app factory: one FastAPI app around an AsyncEngine, with its lifespan, middleware,
exception handlers and the routers of every endpoint family.

Handlers validate and tokenize, then hand the request to the AsyncEngine; they never run
model work. A client that goes away aborts its requests, which frees their KV blocks within
one engine iteration.
"""
from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from engine.async_engine import AsyncEngine
from scheduler.sampling_params import ParamError
from server import VERSION, openapi, protocol
from server.context import ServerContext, ServerSettings
from server.errors import APIError
from server.metrics import API_ENDPOINTS, Metrics
from server.middleware import AuthMiddleware, RequestCounter
from server.routes import chat, completions, messages, responses, utility

logger = logging.getLogger(__name__)


def create_app(async_engine: AsyncEngine, settings: ServerSettings, metrics: Metrics) -> FastAPI:
    """The OpenAI-compatible app; it starts the engine loop on startup and stops it on shutdown."""
    app = FastAPI(title="tandem", version=VERSION, lifespan=_lifespan)
    app.state.context = ServerContext.build(async_engine, settings, metrics)
    if settings.api_keys:
        app.add_middleware(AuthMiddleware, api_keys=settings.api_keys)
    if metrics is not None:  # around the key check, so its 401s count too
        app.add_middleware(RequestCounter, endpoints=API_ENDPOINTS, record=metrics.record_api_request)
    if settings.cors_origins:  # outermost, so a 401 carries CORS headers too
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["*"],
                           allow_headers=["*"])
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(ParamError, _param_error)
    app.add_exception_handler(Exception, _internal_error)
    for family in (completions, chat, responses, utility):  # any route can fail internally: a 500
        app.include_router(family.router, responses=openapi.error_responses(500))
    app.include_router(messages.router, responses=openapi.error_responses(500, anthropic_shape=True))
    openapi.install(app, requires_key=bool(settings.api_keys))
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    async_engine = app.state.context.async_engine
    if not async_engine.is_running:
        async_engine.start()
    yield
    async_engine.shutdown()


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response(request.url.path)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Unknown routes and wrong methods answer in the protocol's error shape too."""
    return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response(request.url.path)


async def _param_error(request: Request, exc: ParamError) -> JSONResponse:
    """A 400 naming the field as the client spelled it: a route whose fields differ from the
    engine's leaves its renames in request.state.param_renames."""
    return protocol.param_error(exc, getattr(request.state, "param_renames", {})).response(request.url.path)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error")
    return APIError(500, f"internal server error: {exc!r}", type="internal_error").response(request.url.path)
