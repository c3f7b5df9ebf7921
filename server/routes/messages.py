"""/v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, translated into the chat
pipeline and back (server/protocols/anthropic.py); errors in Anthropic's shape (server/errors.py).
The anthropic-version header is accepted whatever it says: one version of the API is served."""
from __future__ import annotations

from fastapi import APIRouter, Request

from server.context import Context
from server.openapi import ANTHROPIC_EVENT_STREAM, error_responses, json_body
from server.protocols import anthropic
from server.protocols.anthropic import CountTokensRequest, MessagesRequest
from server.protocols.anthropic_stream import MessageStream, failure_event
from server.routes.chat import chat_prompt, start_chat
from server.routes.shared import read_request
from server.sse import event_stream_response, sse_events

router = APIRouter()


@router.post("/v1/messages", openapi_extra=json_body(MessagesRequest),
             responses={**ANTHROPIC_EVENT_STREAM, **error_responses(400, 404, 413, 429, 503, anthropic_shape=True)})
async def messages(request: Request, ctx: Context):
    req = await read_request(request, MessagesRequest, ctx, anthropic.UNSUPPORTED_PARAMS)
    request.state.param_renames = anthropic.PARAM_RENAMES  # read by the app's ParamError handler
    shaper = await start_chat(anthropic.chat_request(req), ctx)
    if not req.stream:
        return anthropic.message_body(await shaper.response(request))
    stream = MessageStream(ctx.model_name, shaper.submission.num_prompt_tokens)
    return event_stream_response(sse_events(stream.events(shaper.chunks()), named=True),
                                 shaper.submission.abort_unfinished, done="", failure_event=failure_event)


@router.post("/v1/messages/count_tokens", openapi_extra=json_body(CountTokensRequest),
             responses=error_responses(400, 404, 413, anthropic_shape=True))
async def count_tokens(request: Request, ctx: Context) -> dict:
    """The prompt tokens a Messages request with these messages, system prompt and tools would take."""
    req = await read_request(request, CountTokensRequest, ctx, anthropic.UNSUPPORTED_PARAMS)
    request.state.param_renames = anthropic.PARAM_RENAMES
    _, _, prompt_ids = chat_prompt(anthropic.chat_request(req), ctx)
    return {"input_tokens": len(prompt_ids)}
