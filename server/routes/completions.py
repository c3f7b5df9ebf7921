"""/v1/completions: prompts in, text out, whole or streamed, with OpenAI's completion logprobs."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import APIRouter, Request

from engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from engine.text import Tokenizer
from server.context import Context
from server.disconnect import collect_final_outputs
from server.protocol import CompletionRequest
from server.routes.shared import read_request, require_tokenizer, usage
from server.sse import event_stream_response, merge_streams, sse_event
from server.submission import Submission, submit

router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request, ctx: Context):
    req = await read_request(request, CompletionRequest, ctx)
    prompts = req.prompts()
    if any(isinstance(p, str) for p in prompts):
        require_tokenizer(ctx)
    submission = submit(ctx.async_engine, prompts, req.sampling_params())
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
                choices.append(self._choice(prompt_index, completion, prefix + completion.text,
                                            completion.logprobs or [], len(prefix)))
                num_generated += len(completion.token_ids)
        return {**self._header(), "choices": choices, "usage": usage(self.submission, num_generated)}

    async def events(self) -> AsyncIterator[str]:
        include_usage = bool(self.request.stream_options and self.request.stream_options.include_usage)
        num_generated = 0
        text_offsets: dict[int, int] = {}  # choice index -> characters sent so far
        async for prompt_index, output in merge_streams(self.submission.streams):
            for completion in output.outputs:
                if not completion.delta_token_ids and completion.finish_reason is None:
                    continue
                choice_index = prompt_index * self.request.n + completion.index
                text = completion.delta_text
                if choice_index not in text_offsets:  # a choice's first chunk carries the echo
                    text = self._echo_text(prompt_index) + text
                num_generated += len(completion.delta_token_ids)
                offset = text_offsets.get(choice_index, 0)
                chunk = {**self._header(), "choices": [self._choice(prompt_index, completion, text,
                                                                    completion.delta_logprobs or [], offset)]}
                text_offsets[choice_index] = offset + len(text)
                if include_usage:
                    chunk["usage"] = None
                yield sse_event(chunk)
        if include_usage:
            yield sse_event({**self._header(), "choices": [], "usage": usage(self.submission, num_generated)})

    def _header(self) -> dict:
        return {"id": f"cmpl-{self.submission.id}", "object": "text_completion", "created": self.created,
                "model": self.model_name}

    def _choice(self, prompt_index: int, completion: CompletionOutput, text: str, logprobs: list[TokenLogprob],
                text_offset: int) -> dict:
        return {"index": prompt_index * self.request.n + completion.index, "text": text,
                "logprobs": (completion_logprobs(self.tokenizer, logprobs, text_offset)
                             if self.request.logprobs is not None else None),
                "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}

    def _echo_text(self, prompt_index: int) -> str:
        if not self.request.echo:
            return ""
        prepared = self.submission.prepared[prompt_index]
        if prepared.prompt is not None:
            return prepared.prompt
        return self.tokenizer.decode(prepared.prompt_token_ids) if self.tokenizer else ""


def completion_logprobs(tokenizer: Tokenizer | None, entries: list[TokenLogprob], text_offset: int) -> dict:
    """OpenAI's completion logprobs: parallel lists of tokens, their logprobs, the top
    alternatives and each token's character offset, starting at `text_offset`."""
    tokens, token_logprobs, top_logprobs, text_offsets = [], [], [], []
    for entry in entries:
        text = _token_text(tokenizer, entry.token_id)
        tokens.append(text)
        token_logprobs.append(entry.logprob)
        top_logprobs.append({_token_text(tokenizer, token_id): logprob for token_id, logprob in entry.top})
        text_offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offsets}


def _token_text(tokenizer: Tokenizer | None, token_id: int) -> str:
    return tokenizer.token_text(token_id) if tokenizer else str(token_id)
