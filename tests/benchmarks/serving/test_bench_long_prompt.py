"""The long-prompt benchmark (benchmarks/serving/long_prompt_scenario.py, long_prompt_report.py): which gaps
each window counts, the streams' ITL and TPOT on synthetic timings, medians and the table, the texts,
and the long prompt's arrival against a streaming mock transport (no server)."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from benchmarks.load.client import Endpoint, RequestRecord
from benchmarks.serving.long_prompt_report import (Window, before_window, during_window, gaps_overlapping, gaps_within,
                                             itl_p99_over_tpot, itl_stats, median_metrics, num_streams_through,
                                             run_metrics, summarize_run, table)
from benchmarks.serving.long_prompt_scenario import (LongPromptShape, build_texts, prompt_indices,
                                               run_long_prompt)
from benchmarks.load.prompts import PromptBuilder

COMPLETIONS = Endpoint("http://fake", "m", "completions")
SHAPE = LongPromptShape(num_streams=3, num_stream_input_tokens=5, num_stream_output_tokens=12,
                        num_tokens_before_arrival=4, num_long_prompt_tokens=50, num_long_output_tokens=2)

DECODE_S = 0.1  # a decode step on the synthetic timelines
ARRIVAL_S = 1.0  # the long prompt's send
PREFILL_S = 2.0  # its TTFT


class WordCounter:
    """A tokenizer where a word is a token."""

    def count(self, text: str) -> int:
        return len(text.split())


def finished(index: int, token_times_s: list[float], start_s: float = 0.0) -> RequestRecord:
    return RequestRecord(index, 5, len(token_times_s), start_s=start_s, end_s=token_times_s[-1],
                         token_times_s=token_times_s, num_prompt_tokens=5, num_output_tokens=len(token_times_s),
                         usage_reported=True)


def decoding(start_s: float, end_s: float, step_s: float = DECODE_S) -> list[float]:
    """Token times every `step_s` from `start_s` up to `end_s`."""
    times, t = [], start_s
    while t <= end_s + 1e-9:
        times.append(round(t, 9))
        t += step_s
    return times


def long_prompt(ttft_s: float = PREFILL_S) -> RequestRecord:
    first = ARRIVAL_S + ttft_s
    return finished(SHAPE.num_streams, [first, first + DECODE_S], start_s=ARRIVAL_S)


def stalled_streams() -> list[RequestRecord]:
    """Streams that decode every step, stop for the whole prefill, and go on a step after the long
    prompt's first token (as a server that prefills alone and decodes the streams next)."""
    resume_s = ARRIVAL_S + PREFILL_S + DECODE_S
    return [finished(i, decoding(0.2 + 0.05 * i, ARRIVAL_S) + decoding(resume_s, resume_s + 1.0), start_s=0.0)
            for i in range(SHAPE.num_streams)]


def chunked_streams(step_during_s: float = 0.25) -> list[RequestRecord]:
    """Streams whose steps grow to `step_during_s` while the prompt is prefilled in chunks."""
    end_s = ARRIVAL_S + PREFILL_S
    return [finished(i, decoding(0.2, ARRIVAL_S) + decoding(ARRIVAL_S + step_during_s, end_s, step_during_s)
                     + decoding(end_s + DECODE_S, end_s + 1.0)) for i in range(SHAPE.num_streams)]


def test_a_window_counts_the_gaps_inside_or_overlapping_it():
    times = [0.0, 1.0, 2.0, 5.0, 6.0]
    window = Window(1.5, 4.0)
    assert gaps_within(times, window) == []
    assert gaps_overlapping(times, window) == [1.0, 3.0]  # (1, 2) and (2, 5), which outlasts the window
    assert gaps_within(times, Window(0.0, 2.0)) == [1.0, 1.0]  # edges included
    assert gaps_overlapping(times, Window(2.0, 5.0)) == [3.0]  # gaps only touching an edge are out
    assert gaps_overlapping([1.0], window) == gaps_within([], window) == []


def test_before_runs_from_every_streams_first_token_to_the_arrival():
    streams = stalled_streams()
    assert before_window(streams, long_prompt()) == Window(0.3, ARRIVAL_S)  # the last stream's first token
    assert during_window(long_prompt()) == Window(ARRIVAL_S, ARRIVAL_S + PREFILL_S)
    silent = [*streams[:-1], RequestRecord(9, 5, 12, start_s=0.0, end_s=2.0)]
    assert before_window(silent, long_prompt()) is None
    assert during_window(RequestRecord(9, 50, 2, start_s=1.0, end_s=1.5, error="500")) is None


def test_a_whole_prefill_shows_as_one_stall_per_stream():
    streams = stalled_streams()
    run = summarize_run(streams, long_prompt())
    resume_s = ARRIVAL_S + PREFILL_S + DECODE_S
    stalls_s = sorted(resume_s - max(t for t in r.token_times_s if t <= ARRIVAL_S) for r in streams)
    during = run["during"]["itl"]
    assert during["num_gaps"] == SHAPE.num_streams  # each stream's gap from before the send to after the first token
    assert during["max"] == pytest.approx(stalls_s[-1]) and during["p50"] == pytest.approx(stalls_s[1])
    assert run["before"]["itl"]["p50"] == pytest.approx(DECODE_S)
    assert run["before"]["itl"]["p99"] == pytest.approx(DECODE_S)
    assert run["num_streams_through_window"] == SHAPE.num_streams
    assert run["long_prompt"]["ttft"]["p50"] == pytest.approx(PREFILL_S)
    metrics = run_metrics(run)
    assert metrics["long_ttft_s"] == pytest.approx(PREFILL_S)
    assert metrics["itl_p99_over_tpot"] == pytest.approx(during["p99"] / run["streams"]["tpot"]["p50"])
    assert metrics["itl_p99_over_tpot"] > 3  # the stall is many decode steps long


def test_chunks_between_decode_steps_keep_the_gaps_short():
    run = summarize_run(chunked_streams(0.25), long_prompt())
    during = run["during"]["itl"]
    assert during["p50"] == pytest.approx(0.25) and during["max"] == pytest.approx(0.25)
    assert during["num_gaps"] == SHAPE.num_streams * 8  # the step the send falls in, then 7 more
    tpot_s = run["streams"]["tpot"]["p50"]
    assert DECODE_S < tpot_s < 0.25
    assert itl_p99_over_tpot(run) == pytest.approx(0.25 / tpot_s)


def test_itl_stats_percentiles_and_max():
    stats = itl_stats([0.1] * 98 + [0.5, 2.0])
    assert stats["num_gaps"] == 100 and stats["p50"] == pytest.approx(0.1) and stats["max"] == 2.0
    assert 0.5 < stats["p99"] < 2.0  # linear interpolation between order statistics
    assert itl_stats([]) == {"num_gaps": 0, "p50": None, "p99": None, "max": None}


def test_streams_that_end_during_the_window_are_counted_out():
    streams = stalled_streams()
    streams[0] = finished(0, decoding(0.2, 1.5))  # ends before the long prompt's first token
    assert num_streams_through(streams, during_window(long_prompt())) == SHAPE.num_streams - 1
    assert num_streams_through(streams, None) is None


def test_a_failed_long_prompt_leaves_no_window():
    failed = RequestRecord(SHAPE.num_streams, 50, 2, start_s=ARRIVAL_S, end_s=1.2, error="400", error_message="long")
    run = summarize_run(stalled_streams(), failed)
    assert run["during"] is None and run["num_streams_through_window"] is None
    assert run["before"] is not None  # the streams still ran before it
    metrics = run_metrics(run)
    assert metrics["long_ttft_s"] is None and metrics["during_itl_p99"] is None
    assert metrics["itl_p99_over_tpot"] is None


def test_medians_over_repetitions_and_the_table():
    runs = [summarize_run(stalled_streams(), long_prompt(ttft)) for ttft in (0.5, 2.0, 1.0)]
    assert median_metrics(runs)["long_ttft_s"] == pytest.approx(1.0)
    chunked = [summarize_run(chunked_streams(), long_prompt())]
    text = table([{"name": "unchunked", "runs": runs}, {"name": "chunked", "runs": chunked}])
    lines = text.splitlines()
    assert lines[0].startswith("| system | ok/sent | streams through | long prompt TTFT s |")
    assert "ITL p99 / TPOT p50 (target <= 3)" in lines[0]
    assert lines[2].startswith("| unchunked | 12/12 | 3/3 | 1.00 | 100.0 | 100.0 |")
    assert lines[3].startswith("| chunked | 4/4 | 3/3 | 2.00 | 100.0 | 100.0 | 250.0 | 250.0 | 250.0 |")


def test_shape_is_checked_and_bounds_the_context():
    assert SHAPE.num_max_context_tokens == 52
    with pytest.raises(ValueError, match="positive"):
        LongPromptShape(0, 5, 12, 4, 50, 2)
    with pytest.raises(ValueError, match="still be running"):
        LongPromptShape(3, 5, 12, 12, 50, 2)


def test_each_repetition_has_its_own_texts_of_exact_lengths():
    builder = PromptBuilder(WordCounter(), seed=0)
    first, second = build_texts(builder, SHAPE, rep=0), build_texts(builder, SHAPE, rep=1)
    assert first.exact and second.exact
    assert [len(p.split()) for p in first.stream_prompts] == [5, 5, 5] and len(first.long_prompt.split()) == 50
    assert len({*first.stream_prompts, *second.stream_prompts}) == 6 and first.long_prompt != second.long_prompt
    assert build_texts(PromptBuilder(WordCounter(), seed=0), SHAPE, rep=0) == first
    assert prompt_indices(SHAPE, 1) == ([4, 5, 6], 7)
    assert not build_texts(PromptBuilder(None), SHAPE, rep=0).exact


def token_chunks(num_tokens: int, step_s: float):
    """A completion's SSE body, one token every `step_s`, with usage."""
    async def body():
        for i in range(num_tokens):
            await asyncio.sleep(step_s)
            token = {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
            yield f"data: {json.dumps(token)}\n\n".encode()
        usage = {"prompt_tokens": 5, "completion_tokens": num_tokens, "total_tokens": 5 + num_tokens}
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode()
    return body()


def test_the_long_prompt_arrives_once_every_stream_has_its_tokens():
    texts = build_texts(PromptBuilder(WordCounter()), SHAPE, rep=0)
    sent = []

    async def handler(request):
        body = json.loads(request.content)
        sent.append(body)
        return httpx.Response(200, content=token_chunks(body["max_tokens"], 0.002))

    streams, long = asyncio.run(run_long_prompt(COMPLETIONS, SHAPE, texts, request_timeout_s=10.0, progress=False,
                                                transport=httpx.MockTransport(handler)))
    assert all(r.ok and r.num_output_tokens == SHAPE.num_stream_output_tokens for r in streams)
    assert long.ok and long.num_output_tokens == SHAPE.num_long_output_tokens and long.index == SHAPE.num_streams
    assert sent[-1]["prompt"] == texts.long_prompt and sent[-1]["max_tokens"] == SHAPE.num_long_output_tokens
    for r in streams:  # sent once each stream had its tokens, while every one still ran
        assert r.token_times_s[SHAPE.num_tokens_before_arrival - 1] <= long.start_s < r.end_s
