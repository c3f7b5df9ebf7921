"""A long prompt arriving among running streams: its shape, its texts, and running it once.

`num_streams` streaming completions (short prompts, long outputs) start together; once every one
has received `num_tokens_before_arrival` tokens, one more streamed request with a long prompt and
a short output arrives. Everything then runs to the end, so the streams' TPOT covers the whole
run. What a server does with the long prompt's prefill (one iteration that stalls every stream,
or chunks between their decode steps) shows in the streams' inter-token gaps while it is
prefilled; benchmarks/serving/long_prompt_report.py measures them. Texts come from
benchmarks/load/prompts.py's seeded word streams: each repetition gets its own, the same for every
system, so no prompt is answered from a prefix cache.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx

from benchmarks.load.client import Endpoint, RequestRecord
from benchmarks.load.prompts import PromptBuilder
from benchmarks.load.runner import open_client, progress_bar, send_within

# How often the harness looks whether every stream has its tokens; the long prompt's arrival is
# its own send time, so this only delays the arrival, it does not blur the window.
ARRIVAL_POLL_S = 0.005


@dataclass(frozen=True)
class LongPromptShape:
    """How many running streams, and each request's lengths (tokens)."""
    num_streams: int
    num_stream_input_tokens: int
    num_stream_output_tokens: int
    num_tokens_before_arrival: int  # each stream's tokens before the long prompt is sent
    num_long_prompt_tokens: int
    num_long_output_tokens: int

    def __post_init__(self) -> None:
        if min(self.num_streams, self.num_stream_input_tokens, self.num_stream_output_tokens,
               self.num_tokens_before_arrival, self.num_long_prompt_tokens, self.num_long_output_tokens) < 1:
            raise ValueError(f"every count of the long-prompt run must be positive: {self}")
        if self.num_tokens_before_arrival >= self.num_stream_output_tokens:
            raise ValueError(f"the streams must still be running when the long prompt arrives: "
                             f"{self.num_tokens_before_arrival} tokens before it, of {self.num_stream_output_tokens}")

    @property
    def num_max_context_tokens(self) -> int:
        """The longest request's prompt plus output."""
        return max(self.num_long_prompt_tokens + self.num_long_output_tokens,
                   self.num_stream_input_tokens + self.num_stream_output_tokens)


@dataclass(frozen=True)
class LongPromptTexts:
    """One repetition's prompts."""
    stream_prompts: tuple[str, ...]
    long_prompt: str
    exact: bool  # every text has its target token count, as the endpoint's tokenizer counts


def prompt_indices(shape: LongPromptShape, rep: int) -> tuple[list[int], int]:
    """The prompt builder's indices of repetition `rep`'s streams and long prompt: each repetition
    its own block, so a server kept running across repetitions meets no prompt twice."""
    first = rep * (shape.num_streams + 1)
    return list(range(first, first + shape.num_streams)), first + shape.num_streams


def build_texts(builder: PromptBuilder, shape: LongPromptShape, rep: int) -> LongPromptTexts:
    stream_indices, long_index = prompt_indices(shape, rep)
    streams = [builder.build(i, shape.num_stream_input_tokens) for i in stream_indices]
    long = builder.build(long_index, shape.num_long_prompt_tokens)
    return LongPromptTexts(tuple(p.text for p in streams), long.text,
                           exact=builder.counter is not None and all(p.exact for p in [*streams, long]))


def stream_records(shape: LongPromptShape) -> list[RequestRecord]:
    return [RequestRecord(i, shape.num_stream_input_tokens, shape.num_stream_output_tokens)
            for i in range(shape.num_streams)]


def long_record(shape: LongPromptShape) -> RequestRecord:
    return RequestRecord(shape.num_streams, shape.num_long_prompt_tokens, shape.num_long_output_tokens)


def all_decoding(streams: list[RequestRecord], tasks: list[asyncio.Future], num_tokens: int) -> bool:
    """Whether every stream has `num_tokens` tokens or has ended (one that ended early would hold
    the long prompt back for ever)."""
    return all(len(r.token_times_s) >= num_tokens or task.done() for r, task in zip(streams, tasks))


async def run_long_prompt(endpoint: Endpoint, shape: LongPromptShape, texts: LongPromptTexts, *,
                          request_timeout_s: float, description: str = "", progress: bool = True,
                          transport: httpx.AsyncBaseTransport | None = None,
                          poll_s: float = ARRIVAL_POLL_S) -> tuple[list[RequestRecord], RequestRecord]:
    """The streams, then the long prompt once they are decoding; their records and its record.

    `transport` replaces the network (tests pass an httpx.MockTransport).
    """
    streams, long = stream_records(shape), long_record(shape)
    bar = progress_bar(shape.num_streams + 1, description, progress)

    async with open_client(endpoint, request_timeout_s, transport) as client:
        clock_zero = time.perf_counter()

        async def one(prompt: str, record: RequestRecord) -> None:
            await send_within(client, endpoint, prompt, record, clock_zero, request_timeout_s)
            bar.update()

        tasks = [asyncio.ensure_future(one(p, r)) for p, r in zip(texts.stream_prompts, streams)]
        while not all_decoding(streams, tasks, shape.num_tokens_before_arrival):
            await asyncio.sleep(poll_s)
        await asyncio.gather(one(texts.long_prompt, long), *tasks)
    bar.close()
    return streams, long
