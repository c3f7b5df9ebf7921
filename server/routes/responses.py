"""/v1/responses: OpenAI's Responses API, stateless, translated into the chat pipeline and back
(server/protocols/responses.py)."""
from __future__ import annotations

from fastapi import APIRouter, Request

from server.context import Context
from server.openapi import NAMED_EVENT_STREAM, error_responses, json_body
from server.protocols import responses
from server.protocols.responses import ResponsesRequest
from server.protocols.responses_stream import ResponseStream
from server.routes.chat import start_chat
from server.routes.shared import read_request
from server.sse import event_stream_response, sse_events

router = APIRouter()


@router.post("/v1/responses", openapi_extra=json_body(ResponsesRequest),
             responses={**NAMED_EVENT_STREAM, **error_responses(400, 404, 413, 429, 503)})
async def create_response(request: Request, ctx: Context):
    req = await read_request(request, ResponsesRequest, ctx, responses.UNSUPPORTED_PARAMS)
    request.state.param_renames = responses.PARAM_RENAMES  # read by the app's ParamError handler
    shaper = await start_chat(responses.chat_request(req, ctx.model_name), ctx)
    if not req.stream:
        chat = await shaper.response(request)
        return responses.response_body(req, chat, responses.output_items(chat))
    stream = ResponseStream(req)
    return event_stream_response(sse_events(stream.events(shaper.chunks()), named=True),
                                 shaper.submission.abort_unfinished, done="", failure_event=stream.failure_event)
