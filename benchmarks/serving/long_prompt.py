"""Long-prompt benchmark: what running streams see while a server prefills a long prompt.

A chat frontend or an agent keeps several streams decoding when a request with a long prompt (a
document, a long context) arrives. A server that prefills it in one iteration stops every stream
for the whole prefill; one that prefills it in chunks between decode steps (tandem's
--max-num-batched-tokens) keeps them going and pays in the long prompt's TTFT. The run
(benchmarks/serving/long_prompt_scenario.py): --num-streams streamed completions with short prompts and
long outputs (ignore_eos, as in `tandem bench serve`); once each has --tokens-before-arrival
tokens, one streamed request with a --long-prompt-tokens prompt. Reported per system, medians over
repetitions (benchmarks/serving/long_prompt_report.py): the running streams' ITL p50/p99/max from the
long prompt's send until its first token, their ITL before it arrived, their TPOT p50 over the
whole run, ITL p99 / TPOT p50 (the target: at most 3), and the long prompt's TTFT.

Each --system is started afresh for every repetition (A B C, then C B A, so drift hits all alike);
every repetition has its own texts (measured with the first system's /tokenize), the same for
every system, so no prompt is answered from a prefix cache.

    python -m benchmarks.serving.long_prompt --reps 3 \\
        --system 'chunked=tandem serve --port {port} --max-model-len 8192' \\
        --system 'unchunked=tandem serve --port {port} --max-model-len 8192 --max-num-batched-tokens 8192'
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time
from pathlib import Path

import httpx

from benchmarks.serving import long_prompt_report as report
from benchmarks.load.client import Endpoint, max_model_len
from benchmarks.serving.long_prompt_scenario import LongPromptShape, LongPromptTexts, build_texts, run_long_prompt
from benchmarks.load.harness import (WARMUP_INPUT_TOKENS, BenchmarkError, add_median_run_args, add_target_args, connect,
                                  medians_label, prompt_builder, run_and_write, run_info, run_systems, warm_up)


def build_parser(prog: str | None = None, default_output: Path = Path("long_prompt.json")) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_args(ap, "start this system per repetition instead (repeatable)")
    work = ap.add_argument_group("requests")
    work.add_argument("--num-streams", type=int, default=8, help="streams running when the long prompt arrives")
    work.add_argument("--stream-input-len", type=int, default=64, help="tokens of each stream's prompt")
    work.add_argument("--stream-output-len", type=int, default=400, help="tokens each stream generates")
    work.add_argument("--tokens-before-arrival", type=int, default=20,
                      help="tokens every stream has received when the long prompt is sent")
    work.add_argument("--long-prompt-tokens", type=int, default=8000, help="tokens of the long prompt")
    work.add_argument("--long-output-len", type=int, default=16, help="tokens the long prompt's request generates")
    work.add_argument("--seed", type=int, default=0)
    add_median_run_args(ap, default_output, request_timeout_s=600.0, unit="request")
    return ap


def shape_of(args) -> LongPromptShape:
    return LongPromptShape(args.num_streams, args.stream_input_len, args.stream_output_len,
                           args.tokens_before_arrival, args.long_prompt_tokens, args.long_output_len)


class LongPromptBench:
    """Holds what stays fixed across systems: the shape and, once built, each repetition's texts."""

    def __init__(self, args) -> None:
        self.args = args
        self.shape = shape_of(args)
        self.texts: list[LongPromptTexts] | None = None
        self.warmup_prompts: dict[int, str] = {}

    def measure(self, url: str, name: str, rep: int) -> dict:
        """Repetition `rep` of the run against the endpoint at `url`."""
        args = self.args
        with connect(url, args, "completions") as (http, endpoint):
            self._check_context(name, max_model_len(http, endpoint.model))
            if self.texts is None:
                self._build_texts(http, endpoint.model)
            warm_up(endpoint, self.warmup_prompts, args.request_timeout)
            return self._run(endpoint, name, rep)

    def _check_context(self, name: str, limit: int | None) -> None:
        if limit is not None and self.shape.num_max_context_tokens > limit:
            raise BenchmarkError(f"{name}: the long prompt and its output take {self.shape.num_max_context_tokens} "
                                 f"tokens, over its context of {limit}; a larger --max-model-len or a shorter "
                                 f"--long-prompt-tokens")

    def _build_texts(self, http: httpx.Client, model: str) -> None:
        builder = prompt_builder(http, model, chat=False, seed=self.args.seed)
        self.texts = [build_texts(builder, self.shape, rep) for rep in range(self.args.reps)]
        # past every repetition's indices, so a warm-up shares no prefix with a measured prompt
        first = self.args.reps * (self.shape.num_streams + 1)
        self.warmup_prompts = {first + i: builder.build(first + i, WARMUP_INPUT_TOKENS).text
                               for i in range(self.args.warmup)}

    def _run(self, endpoint: Endpoint, name: str, rep: int) -> dict:
        args = self.args
        started_at, cpu_at_start = time.time(), time.process_time()
        streams, long = asyncio.run(run_long_prompt(
            endpoint, self.shape, self.texts[rep], request_timeout_s=args.request_timeout,
            description=f"{name}" + (f" rep {rep}" if args.reps > 1 else ""), progress=not args.no_progress))
        client_cpu_s = time.process_time() - cpu_at_start  # the harness shares the machine it measures
        run = report.summarize_run(streams, long)
        _check_run(name, run)
        run.update(rep=rep, started_at=started_at, client_cpu_s=client_cpu_s, texts_exact=self.texts[rep].exact)
        if args.save_requests:
            run["requests"] = [dataclasses.asdict(r) for r in [*streams, long]]
        return run


def _check_run(name: str, run: dict) -> None:
    """Fail when the long prompt failed (there is no window to measure); warn about what weakens it."""
    long = run["long_prompt"]
    if not long["num_succeeded"]:
        raise BenchmarkError(f"{name}: the long prompt failed: {long['first_error']}")
    streams = run["streams"]
    if streams["num_failed"]:
        print(f"warning: {name}: {streams['num_failed']} of {streams['num_sent']} streams failed "
              f"{streams['errors']}; first: {streams['first_error']}", file=sys.stderr)
    num_through, num_streams = run["num_streams_through_window"], streams["num_requests"]
    if num_through is not None and num_through < num_streams:
        print(f"warning: {name}: only {num_through} of {num_streams} streams ran until the long prompt's first "
              f"token; longer --stream-output-len", file=sys.stderr)


def run_benchmark(args) -> dict:
    bench = LongPromptBench(args)
    names, system_rows = run_systems(args, lambda url, name, rep: [bench.measure(url, name, rep)])
    return {"benchmark": "long_prompt", "title": title(names, bench.shape, args),
            **run_info(args),
            "shape": dataclasses.asdict(bench.shape),
            "texts_exact": all(t.exact for t in bench.texts or []),
            "systems": system_rows,
            "medians": {row["name"]: report.median_metrics(row["runs"]) for row in system_rows}}


def title(names: list[str], shape: LongPromptShape, args) -> str:
    return (f"{' vs '.join(names)}: {shape.num_streams} streams ({shape.num_stream_input_tokens}-token prompts, "
            f"{shape.num_stream_output_tokens} output tokens) decoding when a {shape.num_long_prompt_tokens}-token "
            f"prompt ({shape.num_long_output_tokens} output tokens) arrives after {shape.num_tokens_before_arrival} "
            f"tokens each; {medians_label(args.reps)}")


def main(argv: list[str] | None = None, prog: str | None = None,
         default_output: Path = Path("long_prompt.json")) -> int:
    """Run the benchmark; results go to --output (default `default_output`) and its .md beside it."""
    args = build_parser(prog, default_output).parse_args(argv)
    results = run_and_write("long-prompt", args, run_benchmark, lambda results: report.table(results["systems"]))
    return 0 if results is not None else 1


if __name__ == "__main__":
    sys.exit(main())
