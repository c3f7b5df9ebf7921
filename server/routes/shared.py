"""What several endpoint families do alike: read and check a request, require a tokenizer,
render a chat, count usage."""
from __future__ import annotations

from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel

from engine.outputs import CompletionOutput
from engine.text import Tokenizer, TokenizerError
from server import protocol
from server.context import ServerContext
from server.errors import APIError, bad_request
from server.middleware import read_json_body
from server.submission import Submission
from server.tool_calls.registry import renders_tools
from server.tool_calls.tool_use import ToolUse, template_messages

RequestBody = TypeVar("RequestBody", bound=BaseModel)


async def read_request(request: Request, body_cls: type[RequestBody], ctx: ServerContext,
                       unsupported: dict[str, str] = protocol.UNSUPPORTED_PARAMS) -> RequestBody:
    """The body, size-limited and validated as `body_cls` (`unsupported`: the parameters its protocol
    has that tandem refuses); a 404 unless it names the served model."""
    body = protocol.parse(body_cls, await read_json_body(request, ctx.settings.max_body_bytes), unsupported)
    if body.model is not None and body.model != ctx.model_name:
        raise APIError(404, f"the model '{body.model}' does not exist; this server serves '{ctx.model_name}'",
                       param="model", code="model_not_found")
    return body


def require_tokenizer(ctx: ServerContext) -> Tokenizer:
    """The tokenizer, or a 400 for a model that has none (dummy weights)."""
    if ctx.tokenizer is None:
        raise bad_request("this model has no tokenizer (dummy weights): send token ids", param="prompt")
    return ctx.tokenizer


def render_chat(tokenizer: Tokenizer, messages: list[protocol.ChatMessage], add_generation_prompt: bool,
                tool_use: ToolUse | None = None) -> list[int]:
    """The token ids of `messages` (and the tools of `tool_use`) through the model's chat template;
    a template error is a 400."""
    tool_use = tool_use or ToolUse(native=renders_tools(tokenizer.chat_template or ""))
    conversation = template_messages(messages, tool_use)
    try:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                             **tool_use.template_kwargs())
    except TokenizerError as exc:
        raise bad_request(str(exc), param="messages") from None
    # the template writes its own special tokens
    return tokenizer.encode(text, add_special_tokens=False)


def usage(submission: Submission, num_generated: int, num_cached: int) -> dict:
    """OpenAI's usage object: the prompt tokens of every prompt (`num_cached` of them found in the
    prefix cache), and the tokens generated."""
    return {"prompt_tokens": submission.num_prompt_tokens, "completion_tokens": num_generated,
            "total_tokens": submission.num_prompt_tokens + num_generated,
            "prompt_tokens_details": {"cached_tokens": num_cached}}


def has_news(completion: CompletionOutput, choice_index: int, finished: set[int]) -> bool:
    """Whether a choice's latest output is worth a stream chunk: new tokens, or its finish not sent
    yet. A request's outputs repeat every choice whenever any has news (n > 1), so a choice that
    finished earlier must not finish again. `finished`: the choices whose finish was sent; updated."""
    if completion.finish_reason is None:
        return bool(completion.delta_token_ids)
    if choice_index in finished and not completion.delta_token_ids:
        return False
    finished.add(choice_index)
    return True
