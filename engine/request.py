"""A user request: its inputs checked against the model, then one prompt and its n samples,
each a scheduler `Sequence`.

`SamplingParams` checks its own fields when it is built (the server builds it from the OpenAI
parameters); what depends on the model is checked here by `InputProcessor`, once, before
anything is queued: the prompt's tokens, the context length, token ids within the vocabulary.
Every refusal is a `ParamError` naming the field.

A `Request` fans its parameters out to the samples when it is created and gathers their state
into a `RequestOutput` after each step; a sequence carries its own tokens, text stream and
logprobs, so nothing about a sample is kept twice.
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, replace
from typing import Callable

from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.structured import GrammarBackend, GrammarError, create_grammar_backend
from engine.text import IncrementalDetokenizer, Tokenizer
from scheduler.sampling_params import ParamError, SamplingParams
from scheduler.sequence import Sequence
from scheduler.structured_output import GrammarState


@dataclass(frozen=True)
class PreparedRequest:
    """A tokenized, checked request; `params.max_tokens` is filled in."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    new_grammar: Callable[[], GrammarState] | None = None  # a sample's start in its structured output's grammar


class InputProcessor:
    """Tokenizes and checks requests against the model, and compiles their structured outputs.
    Touches no engine state, so it is safe to call from any thread (the server calls it on the
    event loop, or on a worker thread when there is a grammar to compile)."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, max_model_len: int,
                 eos_token_ids: tuple[int, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self._grammar_backend: GrammarBackend | None = None  # built at the first structured request
        self._grammar_lock = threading.Lock()

    def prepare(self, prompt: str | list[int], params: SamplingParams | None = None) -> PreparedRequest:
        params = params or SamplingParams()
        text, token_ids = self._tokenize(prompt)
        self._check_vocabulary(params)
        params = self._fit_context(token_ids, params)
        return PreparedRequest(text, token_ids, params, self._compile_grammar(params))

    def _compile_grammar(self, params: SamplingParams) -> Callable[[], GrammarState] | None:
        structured = params.structured
        if structured is None:
            return None
        if self.tokenizer is None:
            raise ParamError(structured.param, "structured outputs need the model's tokenizer; "
                                               "this model has none (dummy weights)")
        with self._grammar_lock:
            if self._grammar_backend is None:
                self._grammar_backend = create_grammar_backend(self.tokenizer, self.vocab_size, self.eos_token_ids)
        try:
            compiled = self._grammar_backend.compile(structured)
        except GrammarError as exc:
            raise ParamError(structured.param, f"{structured.param} cannot be compiled into a grammar: {exc}") from None
        return functools.partial(self._grammar_backend.start, compiled)

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ParamError("prompt", "this model has no tokenizer (dummy weights): pass token ids")
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
            if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in token_ids):
                raise ParamError("prompt", f"prompt token ids must be integers in [0, {self.vocab_size})")
        if not token_ids:
            raise ParamError("prompt", "the prompt is empty")
        return text, token_ids

    def _check_vocabulary(self, params: SamplingParams) -> None:
        vocab = self.vocab_size
        if params.logit_bias and any(t >= vocab for t in params.logit_bias):
            raise ParamError("logit_bias", f"logit_bias has token ids outside the vocabulary (size {vocab})")
        if any(t >= vocab for t in params.stop_token_ids):
            raise ParamError("stop_token_ids", f"stop_token_ids has ids outside the vocabulary (size {vocab})")

    def _fit_context(self, prompt_ids: list[int], params: SamplingParams) -> SamplingParams:
        limit = self.max_model_len
        if len(prompt_ids) >= limit:
            raise ParamError("prompt", f"the prompt has {len(prompt_ids)} tokens; this model's context "
                                       f"length is {limit}, leaving no room to generate")
        if params.max_tokens is None:
            return replace(params, max_tokens=limit - len(prompt_ids))
        if len(prompt_ids) + params.max_tokens > limit:
            raise ParamError("max_tokens", f"this model's context length is {limit} tokens, but "
                                           f"{len(prompt_ids)} prompt tokens + {params.max_tokens} max_tokens "
                                           f"= {len(prompt_ids) + params.max_tokens}")
        return params



@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[Sequence]  # the n samples, in index order
    metrics: RequestMetrics

    @classmethod
    def create(cls, request_id: str, prepared: PreparedRequest, metrics: RequestMetrics,
               eos_token_ids: tuple[int, ...], tokenizer: Tokenizer | None) -> "Request":
        params, prompt_ids = prepared.params, prepared.prompt_token_ids
        sequences = []
        for index in range(params.n):
            sample_params = params
            if params.n > 1:  # each sample its own stream; seeded ones stay reproducible
                sample_params = replace(params, n=1, seed=None if params.seed is None else params.seed + index)
            sequences.append(Sequence(
                request_id if params.n == 1 else f"{request_id}#{index}", list(prompt_ids), sample_params,
                eos_token_ids=eos_token_ids, arrival_time=metrics.arrival_time, request_id=request_id,
                text=IncrementalDetokenizer(tokenizer, prompt_ids, sample_params) if tokenizer else None,
                logprobs=[] if params.logprobs is not None else None,
                grammar=prepared.new_grammar() if prepared.new_grammar else None))
        return cls(request_id, prepared.prompt, prompt_ids, sequences, metrics)

    @property
    def finished(self) -> bool:
        return all(seq.finished for seq in self.sequences)

    def take_output(self) -> RequestOutput:
        """Everything so far, with what is new since the previous output as deltas."""
        outputs = [_completion(index, seq) for index, seq in enumerate(self.sequences)]
        self.metrics.num_preemptions = sum(seq.num_preemptions for seq in self.sequences)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs, self.finished,
                             self.metrics, self._prompt_logprobs(), self._num_cached_tokens())

    def _num_cached_tokens(self) -> int:
        """The first sample's: its siblings wait for its blocks and would count them as cached."""
        return self.sequences[0].num_cached_prompt_tokens or 0

    def _prompt_logprobs(self) -> list | None:
        """The same for every sample: whichever prefilled first."""
        return next((seq.prompt_logprobs for seq in self.sequences if seq.prompt_logprobs is not None), None)


def _completion(index: int, seq: Sequence) -> CompletionOutput:
    start = seq.num_reported_tokens
    seq.num_reported_tokens = seq.num_output_tokens
    return CompletionOutput(
        index=index, text=seq.text.text if seq.text else "", token_ids=list(seq.output_token_ids),
        finish_reason=seq.status.value if seq.finished else None, stop_reason=seq.stop_reason,
        logprobs=seq.logprobs, delta_text=seq.text.take_text() if seq.text else "",
        delta_token_ids=seq.output_token_ids[start:],
        delta_logprobs=seq.logprobs[start:] if seq.logprobs is not None else None)
