"""The HTTP front end: OpenAI routes, SSE streaming, auth, body limits, /metrics.

Handlers validate and tokenize, then hand the request to the AsyncEngine; they never run
model work. A client that goes away aborts its requests, which frees their KV blocks within
one engine iteration.
"""
from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from engine.async_engine import AsyncEngine
from engine.outputs import TokenLogprob
from engine.text import TokenizerError
from scheduler.request import ParamError
from server import protocol
from server.disconnect import collect_final_outputs
from server.errors import APIError, bad_request
from server.metrics import Metrics
from server.middleware import AuthMiddleware, read_json_body
from server.sse import event_stream_response, merge_streams, sse_event
from server.submission import Submission, submit

logger = logging.getLogger(__name__)
VERSION = "0.1.0"


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 4 * 2**20
    cors_origins: tuple[str, ...] = ()


def create_app(async_engine: AsyncEngine, settings: ServerSettings, metrics: Metrics) -> FastAPI:
    engine = async_engine.engine
    tokenizer = engine.tokenizer
    model_name = settings.served_model_name

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        if not async_engine.is_running:
            async_engine.start()
        yield
        async_engine.shutdown()

    app = FastAPI(title="tandem", version=VERSION, lifespan=lifespan)
    if settings.api_keys:
        app.add_middleware(AuthMiddleware, api_keys=settings.api_keys)
    if settings.cors_origins:  # outermost, so a 401 carries CORS headers too
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["*"],
                           allow_headers=["*"])

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(HTTPException)
    async def _http_error(_request: Request, exc: HTTPException) -> JSONResponse:
        """Unknown routes and wrong methods answer in OpenAI's shape too."""
        return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response()

    app.add_exception_handler(ParamError, _param_error)

    @app.exception_handler(Exception)
    async def _internal_error(_request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return APIError(500, f"internal server error: {exc!r}", type="internal_error").response()

    # ---- helpers ------------------------------------------------------------------------
    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{model_name}'",
                           param="model", code="model_not_found")

    def require_tokenizer() -> None:
        if tokenizer is None:
            raise bad_request("this model has no tokenizer (dummy weights): send token ids", param="prompt")

    def usage(submission: Submission, outputs_tokens: int) -> dict:
        prompt_tokens = submission.num_prompt_tokens
        return {"prompt_tokens": prompt_tokens, "completion_tokens": outputs_tokens,
                "total_tokens": prompt_tokens + outputs_tokens}

    def completion_logprobs(entries: list[TokenLogprob], offset: int) -> dict:
        tokens, token_logprobs, top, offsets = [], [], [], []
        for entry in entries:
            text = tokenizer.token_text(entry.token_id) if tokenizer else str(entry.token_id)
            tokens.append(text)
            token_logprobs.append(entry.logprob)
            top.append({(tokenizer.token_text(t) if tokenizer else str(t)): lp for t, lp in entry.top})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def chat_logprobs(entries: list[TokenLogprob]) -> dict:
        def item(token_id: int, logprob: float) -> dict:
            if tokenizer is None:
                return {"token": str(token_id), "logprob": logprob, "bytes": None}
            return {"token": tokenizer.token_text(token_id), "logprob": logprob,
                    "bytes": list(tokenizer.token_bytes(token_id))}
        return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                            for e in entries]}

    # ---- OpenAI routes ------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request):
        req = protocol.parse(protocol.CompletionRequest, await read_json_body(request, settings.max_body_bytes))
        check_model(req.model)
        prompts = req.prompts()
        if any(isinstance(p, str) for p in prompts):
            require_tokenizer()
        params = req.sampling_params()
        submission = submit(async_engine, prompts, params)
        response_id, created, n = f"cmpl-{submission.id}", int(time.time()), params.n

        def echo_text(i: int) -> str:
            if not req.echo:
                return ""
            p = submission.prepared[i]
            return p.prompt if p.prompt is not None else (tokenizer.decode(p.prompt_token_ids) if tokenizer else "")

        def choice(prompt_index: int, completion, text: str, logprobs_entries, offset: int) -> dict:
            return {"index": prompt_index * n + completion.index, "text": text,
                    "logprobs": completion_logprobs(logprobs_entries, offset) if req.logprobs is not None else None,
                    "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}

        if not req.stream:
            finals = await collect_final_outputs(request, submission)
            choices, generated = [], 0
            for i, final in enumerate(finals):
                for completion in final.outputs:
                    prefix = echo_text(i)
                    choices.append(choice(i, completion, prefix + completion.text, completion.logprobs or [],
                                          len(prefix)))
                    generated += len(completion.token_ids)
            return {"id": response_id, "object": "text_completion", "created": created, "model": model_name,
                    "choices": choices, "usage": usage(submission, generated)}

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def events() -> AsyncIterator[str]:
            generated = 0
            offsets: dict[int, int] = {}
            echoed: set[int] = set()
            async for i, output in merge_streams(submission.streams):
                for completion in output.outputs:
                    if not completion.delta_token_ids and completion.finish_reason is None:
                        continue
                    key = i * n + completion.index
                    text = completion.delta_text
                    if key not in echoed:
                        echoed.add(key)
                        text = echo_text(i) + text
                    generated += len(completion.delta_token_ids)
                    chunk = {"id": response_id, "object": "text_completion", "created": created,
                             "model": model_name,
                             "choices": [choice(i, completion, text, completion.delta_logprobs or [],
                                                offsets.get(key, 0))]}
                    offsets[key] = offsets.get(key, 0) + len(text)
                    if include_usage:
                        chunk["usage"] = None
                    yield sse_event(chunk)
            if include_usage:
                yield sse_event({"id": response_id, "object": "text_completion", "created": created,
                           "model": model_name, "choices": [], "usage": usage(submission, generated)})

        return event_stream_response(events(), submission.abort_unfinished)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = protocol.parse(protocol.ChatCompletionRequest, await read_json_body(request, settings.max_body_bytes))
        check_model(req.model)
        request.state.param_renames = req.param_renames()  # read by the ParamError handler
        require_tokenizer()
        prompt_ids = _render_chat(tokenizer, req.messages, req.add_generation_prompt)
        params = req.sampling_params()
        submission = submit(async_engine, [prompt_ids], params)
        response_id, created = f"chatcmpl-{submission.id}", int(time.time())

        if not req.stream:
            (final,) = await collect_final_outputs(request, submission)
            choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                        "logprobs": chat_logprobs(c.logprobs or []) if req.logprobs else None,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in final.outputs]
            generated = sum(len(c.token_ids) for c in final.outputs)
            return {"id": response_id, "object": "chat.completion", "created": created, "model": model_name,
                    "choices": choices, "usage": usage(submission, generated)}

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choices: list[dict], **extra) -> str:
            body = {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model_name,
                    "choices": choices, **extra}
            if include_usage and "usage" not in body:
                body["usage"] = None
            return sse_event(body)

        async def events() -> AsyncIterator[str]:
            generated = 0
            for index in range(params.n):  # the assistant role opens every choice
                yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])
            async for _, output in merge_streams(submission.streams):
                for c in output.outputs:
                    if not c.delta_token_ids and c.finish_reason is None:
                        continue
                    generated += len(c.delta_token_ids)
                    delta = {"content": c.delta_text} if c.delta_text or c.finish_reason is None else {}
                    yield chunk([{"index": c.index, "delta": delta,
                                  "logprobs": chat_logprobs(c.delta_logprobs or []) if req.logprobs else None,
                                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}])
            if include_usage:
                yield chunk([], usage=usage(submission, generated))

        return event_stream_response(events(), submission.abort_unfinished)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "tandem", "root": engine.config.model,
                                            "max_model_len": engine.max_model_len}]}

    # ---- utility routes -----------------------------------------------------------------
    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = protocol.parse(protocol.TokenizeRequest, await read_json_body(request, settings.max_body_bytes))
        check_model(req.model)
        require_tokenizer()
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of 'prompt' and 'messages'", param="prompt")
        if req.messages is not None:
            tokens = _render_chat(tokenizer, req.messages, req.add_generation_prompt)
        else:
            tokens = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = protocol.parse(protocol.DetokenizeRequest, await read_json_body(request, settings.max_body_bytes))
        check_model(req.model)
        require_tokenizer()
        vocab = engine.model_config.vocab_size
        if not all(0 <= t < vocab for t in req.tokens):
            raise bad_request(f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @app.get("/health")
    async def health():
        if async_engine.is_running:
            return Response(status_code=200)
        return APIError(503, async_engine.dead_reason or "the engine is not ready",
                        type="service_unavailable").response()

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    return app


async def _param_error(request: Request, exc: ParamError) -> JSONResponse:
    """A 400 naming the field as the client spelled it: a route whose fields differ from the
    engine's leaves its renames in request.state.param_renames."""
    return protocol.param_error(exc, getattr(request.state, "param_renames", {})).response()


def _render_chat(tokenizer, messages: list[protocol.ChatMessage], add_generation_prompt: bool) -> list[int]:
    conversation = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
    try:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    except TokenizerError as exc:
        raise bad_request(str(exc), param="messages") from None
    # the template writes its own special tokens
    return tokenizer.encode(text, add_special_tokens=False)
