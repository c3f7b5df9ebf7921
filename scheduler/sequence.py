"""One generated sequence (one of a request's n samples): the scheduler's unit of work.

Plain Python, no torch. The scheduler owns a sequence's lifecycle fields (status, blocks, tier,
computed tokens) and decides, in `Scheduler.update`, when it is finished (see `stop_check`).
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from scheduler.sampling_params import SamplingParams
from scheduler.structured_output import GrammarState


class Tier(enum.Enum):
    """Which KV pool holds a prefilled sequence's blocks (Neo 3.1): it lives wholly in one."""

    GPU = "gpu"  # the GPU pool
    CPU = "cpu"  # the host pool; its decoding attention runs on the CPU


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"  # EOS, a stop token or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or the context length
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                        SequenceStatus.FINISHED_ABORTED)


class TextStream(Protocol):
    """A sequence's text as it grows (engine.text.IncrementalDetokenizer): fed every sampled
    token, it knows when a stop string has matched."""

    stop_string: str | None

    def add(self, token_id: int) -> str:
        """Take one sampled token; return the text it releases."""

    def finish(self) -> str:
        """The sequence ended for another reason: release the text held back."""


@dataclass(eq=False)
class Sequence:
    """One of a request's n samples being generated. `block_ids` is its KV block table."""

    seq_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_prompt_tokens: int | None = None  # prompt tokens the prefix cache held at first admission
    block_ids: list[int] = field(default_factory=list)  # in the pool of `tier`
    block_hashes: list[bytes] = field(default_factory=list)  # of its full blocks so far (prefix caching)
    num_committed_blocks: int = 0  # leading blocks of `block_ids` findable by their hash in their pool
    tier: Tier = Tier.GPU
    num_preemptions: int = 0
    num_swaps: int = 0  # moves between the pools
    last_swap_iteration: int = -(2**31)  # scheduler iteration of the last move (hysteresis)
    cpu_wait_iterations: int = 0  # iterations in a row a CPU-sequence was not scheduled
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    request_id: str = ""  # the user request this sequence is a sample of
    text: TextStream | None = None  # None: no tokenizer (token ids only, no stop strings)
    logprobs: list[Any] | None = None  # one entry per output token, when the request asked for them
    partial_prompt_logprobs: list[Any] = field(default_factory=lambda: [None])  # the entries so far, chunk by chunk
    num_reported_tokens: int = 0  # output tokens already handed to the client
    grammar: GrammarState | None = None  # what its output must match (structured output)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def prompt_logprobs(self) -> list[Any] | None:
        """One entry per prompt token (the first None), once every chunk has given its own."""
        complete = len(self.partial_prompt_logprobs) >= self.num_prompt_tokens
        return self.partial_prompt_logprobs if complete else None

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs and has none yet (a recomputed prefill does not redo them)."""
        return self.sampling_params.prompt_logprobs is not None and self.prompt_logprobs is None

    @property
    def num_prompt_logprob_rows(self) -> int:
        """Prompt positions whose logits have already given their next token's entry."""
        return len(self.partial_prompt_logprobs) - 1

    def add_prompt_logprobs(self, entries: list[Any]) -> None:
        """One chunk's prompt entries, in order (`prompt_logprob_positions` never repeats a row)."""
        self.partial_prompt_logprobs.extend(entries)

    def append_token(self, token_id: int, logprob: Any = None) -> None:
        """One sampled token: into the token ids, the logprobs, the text and the grammar. An EOS
        that ends the sequence is no part of its text (as in vLLM), even with special tokens kept."""
        self.output_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)
        if self.logprobs is not None:
            self.logprobs.append(logprob)
        if self.text is not None and not ends_on_eos(self):
            self.text.add(token_id)


def stop_check(seq: Sequence, max_model_len: int) -> tuple[SequenceStatus, int | str | None] | None:
    """Whether `seq` is finished after its last token, and why: (status, stop reason) or None.

    The one place a generation's end is decided. In order: a structured output's grammar that
    took its end token, EOS and stop token ids (once min_tokens are out), max_tokens or the context length, then a stop string the text matched
    (the text stream itself ignores stop strings before min_tokens). Aborts are the scheduler's.
    """
    params = seq.sampling_params
    token_id = seq.output_token_ids[-1]
    if seq.grammar is not None and seq.grammar.is_terminated():  # ends even before min_tokens or with ignore_eos
        return SequenceStatus.FINISHED_STOPPED, None
    if ends_on_eos(seq):
        return SequenceStatus.FINISHED_STOPPED, None
    if seq.num_output_tokens >= params.min_tokens:
        if token_id in params.stop_token_ids:
            return SequenceStatus.FINISHED_STOPPED, token_id
    max_tokens = params.max_tokens
    if (max_tokens is not None and seq.num_output_tokens >= max_tokens) or seq.num_tokens >= max_model_len:
        return SequenceStatus.FINISHED_LENGTH, None
    if seq.text is not None and seq.text.stop_string is not None:
        return SequenceStatus.FINISHED_STOPPED, seq.text.stop_string
    return None


def ends_on_eos(seq: Sequence) -> bool:
    """Whether the last token is an EOS that ends `seq`: with min_tokens reached and EOS not
    ignored, or as the end its structured output's grammar took."""
    if seq.output_token_ids[-1] not in seq.eos_token_ids:
        return False
    if seq.grammar is not None and seq.grammar.is_terminated():
        return True
    return seq.num_output_tokens >= seq.sampling_params.min_tokens and not seq.sampling_params.ignore_eos
