"""/v1/chat/completions: messages through the chat template, an assistant message out, whole or
streamed, with OpenAI's chat logprobs."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import APIRouter, Request

from engine.outputs import CompletionOutput, TokenLogprob
from engine.text import Tokenizer
from server.context import Context, ServerContext
from server.disconnect import collect_final_outputs
from server.openapi import EVENT_STREAM, error_responses, json_body
from server.protocol import ChatCompletionRequest
from server.routes.shared import has_news, read_request, render_chat, require_tokenizer, usage
from server.sse import event_stream_response, merge_streams, sse_events
from server.submission import Submission, submit
from server.tool_calls import ToolCallStream
from server.tool_calls.tool_use import ToolUse, plan_tool_use

router = APIRouter()


@router.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest),
             responses={**EVENT_STREAM, **error_responses(400, 404, 413, 429, 503)})
async def chat_completions(request: Request, ctx: Context):
    req = await read_request(request, ChatCompletionRequest, ctx)
    request.state.param_renames = req.param_renames()  # read by the app's ParamError handler
    shaper = await start_chat(req, ctx)
    if not req.stream:
        return await shaper.response(request)
    return event_stream_response(sse_events(shaper.chunks()), shaper.submission.abort_unfinished)


async def start_chat(req: ChatCompletionRequest, ctx: ServerContext) -> ChatShaper:
    """Submit a chat request to the engine: the pipeline every chat-shaped protocol runs (the
    Messages and Responses routes translate into it). Its shaper gives the chat.completion body or
    chunks, which those routes translate back."""
    tokenizer, tool_use, prompt_ids = chat_prompt(req, ctx)
    params = tool_use.sampling_params(req.sampling_params(tool_use.structured))
    submission = await submit(ctx.async_engine, [prompt_ids], params)
    return ChatShaper(req, submission, tokenizer, ctx.model_name, int(time.time()), tool_use)


def chat_prompt(req: ChatCompletionRequest, ctx: ServerContext) -> tuple[Tokenizer, ToolUse, list[int]]:
    """The tokenizer, how the request's tools are served, and the prompt's token ids."""
    tokenizer = require_tokenizer(ctx)
    tool_use = plan_tool_use(req, tokenizer.chat_template, ctx.settings.tool_call_parser)
    return tokenizer, tool_use, render_chat(tokenizer, req.messages, req.add_generation_prompt, tool_use)


@dataclass(frozen=True)
class ChatShaper:
    """Shapes one request's engine outputs into a chat.completion body or its stream of chunks
    (as dicts); with tools, the output's tool calls become the message's `tool_calls`."""
    request: ChatCompletionRequest
    submission: Submission
    tokenizer: Tokenizer
    model_name: str
    created: int
    tool_use: ToolUse

    async def response(self, request: Request) -> dict:
        """The chat.completion body once the request finishes (aborted if the client goes away)."""
        (final,) = await collect_final_outputs(request, self.submission)
        choices = [{"index": c.index, **self._message(c), "logprobs": self._logprobs(c.logprobs),
                    "stop_reason": c.stop_reason} for c in final.outputs]
        num_generated = sum(len(c.token_ids) for c in final.outputs)
        return {"id": self._id(), "object": "chat.completion", "created": self.created, "model": self.model_name,
                "choices": choices, "usage": usage(self.submission, num_generated, final.num_cached_tokens)}

    def _message(self, completion: CompletionOutput) -> dict:
        """The choice's message and finish_reason: "tool_calls" when it ended by calling tools."""
        if self.tool_use.parser is None:
            return {"message": {"role": "assistant", "content": completion.text},
                    "finish_reason": completion.finish_reason}
        parsed = self.tool_use.parser.parse(completion.text)
        calls = [call.as_openai() for call in parsed.tool_calls[:None if self.tool_use.parallel else 1]]
        message = {"role": "assistant", "content": parsed.content}
        if calls:
            message["tool_calls"] = calls
        return {"message": message, "finish_reason": _finish_reason(completion.finish_reason, bool(calls))}

    async def chunks(self) -> AsyncIterator[dict]:
        """The chat.completion.chunk bodies: the role, content and tool-call deltas, the finish, and
        with stream_options.include_usage a last chunk of usage."""
        num_generated = num_cached = 0
        for index in range(self.request.n):  # the assistant role opens every choice
            yield self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}])
        finished: set[int] = set()
        tool_streams = {index: ToolCallStream(self.tool_use.parser) for index in range(self.request.n)
                        if self.tool_use.parser is not None}
        async for _, output in merge_streams(self.submission.streams):
            num_cached = output.num_cached_tokens
            for completion in output.outputs:
                if not has_news(completion, completion.index, finished):
                    continue
                num_generated += len(completion.delta_token_ids)
                choice = self._delta_choice(completion, tool_streams.get(completion.index))
                if choice is not None:
                    yield self._chunk([choice])
        if self._include_usage():
            yield self._chunk([], usage=usage(self.submission, num_generated, num_cached))

    def _delta_choice(self, completion: CompletionOutput, tool_stream: ToolCallStream | None) -> dict | None:
        """The choice's chunk; None when a tool-call stream holds all of its news back."""
        finish_reason = completion.finish_reason
        if tool_stream is None:  # the finishing chunk has no content key unless it brings text
            has_content = completion.delta_text or finish_reason is None
            delta = {"content": completion.delta_text} if has_content else {}
        else:
            delta = self._tool_delta(completion, tool_stream)
            finish_reason = _finish_reason(finish_reason, tool_stream.num_calls_sent > 0)
            if not delta and finish_reason is None and not self.request.logprobs:
                return None
        return {"index": completion.index, "delta": delta, "logprobs": self._logprobs(completion.delta_logprobs),
                "finish_reason": finish_reason, "stop_reason": completion.stop_reason}

    def _tool_delta(self, completion: CompletionOutput, tool_stream: ToolCallStream) -> dict:
        news = tool_stream.feed(completion.delta_text)
        if completion.finish_reason is not None:
            rest = tool_stream.finish()
            news.content += rest.content
            news.tool_calls += rest.tool_calls
        delta = {"content": news.content} if news.content else {}
        calls = [call for call in news.tool_calls if self.tool_use.parallel or call["index"] == 0]
        if calls:
            delta["tool_calls"] = calls
        return delta

    def _chunk(self, choices: list[dict], **extra) -> dict:
        body = {"id": self._id(), "object": "chat.completion.chunk", "created": self.created,
                "model": self.model_name, "choices": choices, **extra}
        if self._include_usage() and "usage" not in body:
            body["usage"] = None
        return body

    def _id(self) -> str:
        return f"chatcmpl-{self.submission.id}"

    def _include_usage(self) -> bool:
        return bool(self.request.stream_options and self.request.stream_options.include_usage)

    def _logprobs(self, entries: list[TokenLogprob] | None) -> dict | None:
        return chat_logprobs(self.tokenizer, entries or []) if self.request.logprobs else None


def _finish_reason(finish_reason: str | None, called_tools: bool) -> str | None:
    """OpenAI's "tool_calls" for a turn that ended by itself after calling tools."""
    return "tool_calls" if called_tools and finish_reason == "stop" else finish_reason


def chat_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprob]) -> dict:
    """OpenAI's chat logprobs: per token its text, logprob, UTF-8 bytes and top alternatives."""
    return {"content": [{**_token_logprob(tokenizer, entry.token_id, entry.logprob),
                         "top_logprobs": [_token_logprob(tokenizer, token_id, logprob)
                                          for token_id, logprob in entry.top]}
                        for entry in entries]}


def _token_logprob(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict:
    return {"token": tokenizer.token_text(token_id), "logprob": logprob,
            "bytes": list(tokenizer.token_bytes(token_id))}
