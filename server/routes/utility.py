"""The routes around generation: /v1/models, /tokenize, /detokenize, /health, /metrics, /version."""
from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server import VERSION, protocol
from server.context import Context
from server.errors import APIError, bad_request
from server.openapi import error_responses, json_body
from server.routes.shared import read_request, render_chat, require_tokenizer

PROMETHEUS_TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"

router = APIRouter()


@router.get("/v1/models")
async def models(ctx: Context):
    return {"object": "list", "data": [{"id": ctx.model_name, "object": "model", "created": int(time.time()),
                                        "owned_by": "tandem", "root": ctx.engine.config.model,
                                        "max_model_len": ctx.engine.max_model_len}]}


@router.post("/tokenize", openapi_extra=json_body(protocol.TokenizeRequest),
             responses=error_responses(400, 404, 413))
async def tokenize(request: Request, ctx: Context):
    req = await read_request(request, protocol.TokenizeRequest, ctx)
    tokenizer = require_tokenizer(ctx)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of 'prompt' and 'messages'", param="prompt")
    if req.messages is not None:
        tokens = render_chat(tokenizer, req.messages, req.add_generation_prompt)
    else:
        tokens = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    return {"tokens": tokens, "count": len(tokens), "max_model_len": ctx.engine.max_model_len}


@router.post("/detokenize", openapi_extra=json_body(protocol.DetokenizeRequest),
             responses=error_responses(400, 404, 413))
async def detokenize(request: Request, ctx: Context):
    req = await read_request(request, protocol.DetokenizeRequest, ctx)
    tokenizer = require_tokenizer(ctx)
    vocab_size = ctx.engine.model_config.vocab_size
    if not all(0 <= t < vocab_size for t in req.tokens):
        raise bad_request(f"token ids must be in [0, {vocab_size})", param="tokens")
    return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)}


@router.get("/health", response_class=Response,
            responses={200: {"description": "the engine is running (no body)"}, **error_responses(503)})
async def health(ctx: Context):
    if ctx.async_engine.is_running:
        return Response(status_code=200)
    return APIError(503, ctx.async_engine.dead_reason or "the engine is not ready",
                    type="service_unavailable").response()


@router.get("/metrics", response_class=Response, responses={200: {
    "description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}})
async def prometheus_metrics(ctx: Context):
    return Response(ctx.metrics.render(), media_type=PROMETHEUS_TEXT_FORMAT)


@router.get("/version")
async def version():
    return {"version": VERSION}
