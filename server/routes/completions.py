"""/v1/completions: prompts in, text out, whole or streamed, with OpenAI's completion logprobs
(of the prompt's tokens too, when `echo` asks for the prompt back)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import APIRouter, Request

from engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from engine.text import Tokenizer
from server.context import Context
from server.disconnect import collect_final_outputs
from server.openapi import EVENT_STREAM, error_responses, json_body
from server.protocol import CompletionRequest
from server.routes.shared import has_news, read_request, require_tokenizer, usage
from server.sse import event_stream_response, merge_streams, sse_event
from server.submission import Submission, submit

router = APIRouter()


@router.post("/v1/completions", openapi_extra=json_body(CompletionRequest),
             responses={**EVENT_STREAM, **error_responses(400, 404, 413, 429, 503)})
async def completions(request: Request, ctx: Context):
    req = await read_request(request, CompletionRequest, ctx)
    prompts = req.prompts()
    if any(isinstance(p, str) for p in prompts):
        require_tokenizer(ctx)
    submission = await submit(ctx.async_engine, prompts, req.sampling_params())
    shaper = _CompletionShaper(req, submission, ctx.tokenizer, ctx.model_name, int(time.time()))
    if not req.stream:
        return shaper.response(await collect_final_outputs(request, submission))
    return event_stream_response(shaper.events(), submission.abort_unfinished)


@dataclass(frozen=True)
class _CompletionShaper:
    """Shapes one request's engine outputs into a text_completion body or its stream of chunks.
    Choice indices run prompt by prompt: prompt i's n completions are i*n .. i*n + n-1."""
    request: CompletionRequest
    submission: Submission
    tokenizer: Tokenizer | None
    model_name: str
    created: int

    def response(self, finals: list[RequestOutput]) -> dict:
        choices, num_generated = [], 0
        for prompt_index, final in enumerate(finals):
            for completion in final.outputs:
                prefix = self._echo_text(prompt_index)
                logprobs = self._logprobs(final, completion.logprobs or [], self.request.echo, len(prefix))
                choices.append(self._choice(prompt_index, completion, prefix + completion.text, logprobs))
                num_generated += len(completion.token_ids)
        num_cached = sum(final.num_cached_tokens for final in finals)
        return {**self._header(), "choices": choices, "usage": usage(self.submission, num_generated, num_cached)}

    async def events(self) -> AsyncIterator[str]:
        include_usage = bool(self.request.stream_options and self.request.stream_options.include_usage)
        num_generated = 0
        text_offsets: dict[int, int] = {}  # choice index -> characters sent so far
        num_cached: dict[int, int] = {}  # prompt index -> its prompt tokens found in the prefix cache
        finished: set[int] = set()
        async for prompt_index, output in merge_streams(self.submission.streams):
            num_cached[prompt_index] = output.num_cached_tokens
            for completion in output.outputs:
                choice_index = prompt_index * self.request.n + completion.index
                if not has_news(completion, choice_index, finished):
                    continue
                text, echo = completion.delta_text, ""
                if choice_index not in text_offsets:  # a choice's first chunk carries the echo
                    echo = self._echo_text(prompt_index)
                    text = echo + text
                num_generated += len(completion.delta_token_ids)
                offset = text_offsets.get(choice_index, 0)
                logprobs = self._logprobs(output, completion.delta_logprobs or [],
                                          self.request.echo and choice_index not in text_offsets, offset + len(echo))
                chunk = {**self._header(), "choices": [self._choice(prompt_index, completion, text, logprobs)]}
                text_offsets[choice_index] = offset + len(text)
                if include_usage:
                    chunk["usage"] = None
                yield sse_event(chunk)
        if include_usage:
            yield sse_event({**self._header(), "choices": [],
                             "usage": usage(self.submission, num_generated, sum(num_cached.values()))})

    def _header(self) -> dict:
        return {"id": f"cmpl-{self.submission.id}", "object": "text_completion", "created": self.created,
                "model": self.model_name}

    def _choice(self, prompt_index: int, completion: CompletionOutput, text: str, logprobs: dict | None) -> dict:
        return {"index": prompt_index * self.request.n + completion.index, "text": text, "logprobs": logprobs,
                "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}

    def _logprobs(self, output: RequestOutput, entries: list[TokenLogprob], echoed: bool,
                  text_offset: int) -> dict | None:
        """The choice's logprobs object: the echoed prompt's tokens first (the first one has no
        logprob), then the generated ones from `text_offset` on; None when not asked for."""
        if self.request.logprobs is None:
            return None
        generated = completion_logprobs(self.tokenizer, _rows(entries), text_offset)
        if not echoed:
            return generated
        prompt_rows = [(output.prompt_token_ids[0], None, None), *_rows(output.prompt_logprobs[1:])]
        prompt = completion_logprobs(self.tokenizer, prompt_rows, 0)
        return {key: prompt[key] + generated[key] for key in generated}

    def _echo_text(self, prompt_index: int) -> str:
        if not self.request.echo:
            return ""
        prepared = self.submission.prepared[prompt_index]
        if prepared.prompt is not None:
            return prepared.prompt
        return self.tokenizer.decode(prepared.prompt_token_ids) if self.tokenizer else ""


# (token id, its logprob, the top alternatives): None for a token nothing predicts
_LogprobRow = tuple[int, float | None, list[tuple[int, float]] | None]


def _rows(entries: list[TokenLogprob]) -> list[_LogprobRow]:
    return [(entry.token_id, entry.logprob, entry.top) for entry in entries]


def completion_logprobs(tokenizer: Tokenizer | None, rows: list[_LogprobRow], text_offset: int) -> dict:
    """OpenAI's completion logprobs: parallel lists of tokens, their logprobs, the top
    alternatives and each token's character offset, starting at `text_offset`."""
    tokens, token_logprobs, top_logprobs, text_offsets = [], [], [], []
    for token_id, logprob, top in rows:
        text = _token_text(tokenizer, token_id)
        tokens.append(text)
        token_logprobs.append(logprob)
        top_logprobs.append(None if top is None else {_token_text(tokenizer, alt): lp for alt, lp in top})
        text_offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offsets}


def _token_text(tokenizer: Tokenizer | None, token_id: int) -> str:
    return tokenizer.token_text(token_id) if tokenizer else str(token_id)
