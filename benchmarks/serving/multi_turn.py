"""Multi-turn chat benchmark: what a chat frontend or an agent sees from a server's prefix cache.

Conversations over one shared system prompt (benchmarks/serving/conversation.py) run concurrently
through streamed /v1/chat/completions, each turn re-sending the whole history with the server's
real replies in it, outputs held at a fixed length (ignore_eos, as in `tandem bench serve`).
Reported per system, medians over repetitions: TTFT p50/p90 over all turns and for turn 1 and
turns 2+ apart (only a later turn repeats a prefix beyond the system prompt), ITL and TPOT p50,
output tokens/s and requests/s over the run, the prefix-cache hit rate where /metrics exports one
(tandem:, vllm:) or the responses' usage reports cached tokens (llama.cpp), and the first system's
TTFT and throughput over each peer's.

Each --system is started afresh for every repetition (A B C, then C B A, so drift hits all
alike): every repetition then measures the same thing, a cold cache warming up over the
conversations, and none is answered from an earlier repetition's cache. The same conversations
(texts measured with the first system's /tokenize) go to every system.

    python -m benchmarks.serving.multi_turn --reps 3 \\
        --system 'tandem=tandem serve --port {port} --quantization int4' \\
        --system 'vllm=python -m vllm.entrypoints.openai.api_server --port {port} --enable-prefix-caching ...'
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time
from pathlib import Path

import httpx

from benchmarks.serving import multi_turn_report as report
from benchmarks.load.client import Endpoint, RequestRecord, max_model_len, server_counters, settled_counters
from benchmarks.serving.conversation import (Conversation, ConversationShape, build_conversations,
                                       run_conversations)
from benchmarks.load.harness import (WARMUP_INPUT_TOKENS, BenchmarkError, add_median_run_args, add_target_args, connect,
                                  medians_label, prompt_builder, run_and_write, run_info, run_systems, warm_up)
from benchmarks.load.stats import summarize

TEMPLATE_TOKENS_PER_MESSAGE = 8  # a chat template's role markers, allowed for when checking the context


def build_parser(prog: str | None = None, default_output: Path = Path("multi_turn.json")) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_args(ap, "start this system per repetition instead (repeatable; the first is the baseline)")
    work = ap.add_argument_group("conversations")
    work.add_argument("--num-conversations", type=int, default=16, help="all run at once")
    work.add_argument("--num-turns", type=int, default=6, help="per conversation, in order")
    work.add_argument("--system-prompt-len", type=int, default=400, help="tokens of the shared system prompt")
    work.add_argument("--user-len", type=int, nargs=2, default=[60, 100], metavar=("MIN", "MAX"),
                      help="tokens of each user message, uniform in [MIN, MAX]")
    work.add_argument("--output-len", type=int, default=64, help="tokens of each reply")
    work.add_argument("--think-time", type=float, default=0.0, help="seconds between a reply and the next turn")
    work.add_argument("--seed", type=int, default=0)
    run = add_median_run_args(ap, default_output, request_timeout_s=300.0, unit="turn")
    run.add_argument("--max-duration", type=float, default=1800.0, help="seconds after which no turn is sent")
    return ap


def shape_of(args) -> ConversationShape:
    return ConversationShape(args.num_conversations, args.num_turns, args.system_prompt_len, args.user_len[0],
                             args.user_len[1], args.output_len)


class MultiTurnBench:
    """Holds what stays fixed across systems and repetitions: the shape and, once built, the texts."""

    def __init__(self, args) -> None:
        self.args = args
        self.shape = shape_of(args)
        self.conversations: list[Conversation] | None = None
        self.warmup_prompts: dict[int, str] = {}
        self.texts_exact = False

    def measure(self, url: str, name: str, rep: int) -> dict:
        """One repetition of every conversation against the endpoint at `url`."""
        args = self.args
        with connect(url, args, "chat") as (http, endpoint):
            self._check_context(name, max_model_len(http, endpoint.model))
            if self.conversations is None:
                self._build_texts(http, endpoint.model)
            warm_up(endpoint, self.warmup_prompts, args.request_timeout)
            return self._run(http, endpoint, name, rep)

    def _check_context(self, name: str, limit: int | None) -> None:
        num_messages = 2 * self.shape.num_turns + 1
        needed = self.shape.num_max_context_tokens + TEMPLATE_TOKENS_PER_MESSAGE * num_messages
        if limit is not None and needed > limit:
            raise BenchmarkError(f"{name}: a conversation reaches ~{needed} tokens, over its context of {limit}; "
                                 f"fewer --num-turns or shorter messages")

    def _build_texts(self, http: httpx.Client, model: str) -> None:
        """Texts measured on the raw-text tokenizer (no chat template): a message's own length."""
        builder = prompt_builder(http, model, chat=False, seed=self.args.seed, what="message")
        self.conversations = build_conversations(builder, self.shape, self.args.seed)
        self.texts_exact = builder.counter is not None
        # past every conversation's indices, so a warm-up shares no prefix with a conversation
        first = 1 + self.shape.num_conversations * self.shape.num_turns
        self.warmup_prompts = {first + i: builder.build(first + i, WARMUP_INPUT_TOKENS).text
                               for i in range(self.args.warmup)}

    def _run(self, http: httpx.Client, endpoint: Endpoint, name: str, rep: int) -> dict:
        args = self.args
        started_at, cpu_at_start = time.time(), time.process_time()
        before = server_counters(http)
        records = asyncio.run(run_conversations(
            endpoint, self.conversations, self.shape.num_output_tokens, request_timeout_s=args.request_timeout,
            max_duration_s=args.max_duration, think_time_s=args.think_time,
            description=f"{name}" + (f" rep {rep}" if args.reps > 1 else ""), progress=not args.no_progress))
        client_cpu_s = time.process_time() - cpu_at_start  # the harness shares the machine it measures
        run = summarize_run(records)
        after = settled_counters(http, before, run["summary"]["num_succeeded"])
        _check_failures(name, endpoint, run["summary"])
        counters = ({k: after[k] - before.get(k, 0.0) for k in after}
                    if before is not None and after is not None else None)
        run.update(rep=rep, started_at=started_at, client_cpu_s=client_cpu_s, server_counters=counters,
                   prefix_cache=report.prefix_cache_stats(counters))
        if args.save_requests:
            run["requests"] = [[dataclasses.asdict(r) for r in turns] for turns in records]
        return run


def summarize_run(records: list[list[RequestRecord]]) -> dict:
    """`summarize` rows over all turns, over each conversation's first turn and over the rest, and
    the prompt tokens the server's usage says its cache answered."""
    every = [r for turns in records for r in turns]
    return {"summary": summarize(every),
            "first_turn": summarize([turns[0] for turns in records if turns]),
            "later_turns": summarize([r for turns in records for r in turns[1:]]),
            "usage_cached": report.usage_cached_stats(every)}


def _check_failures(name: str, endpoint: Endpoint, summary: dict) -> None:
    if summary["num_sent"] and not summary["num_succeeded"]:
        raise BenchmarkError(f"every turn sent to {endpoint.base_url}{endpoint.path} failed "
                             f"({summary['errors']}); first: {summary['first_error']}")
    if summary["num_failed"] or summary["num_sent"] < summary["num_requests"]:
        print(f"warning: {name}: {summary['num_succeeded']} of {summary['num_requests']} turns succeeded "
              f"{summary['errors']}; first: {summary['first_error']}", file=sys.stderr)


def run_benchmark(args) -> dict:
    bench = MultiTurnBench(args)
    names, system_rows = run_systems(args, lambda url, name, rep: [bench.measure(url, name, rep)])
    return {"benchmark": "multi_turn", "title": title(names, bench.shape, args),
            **run_info(args),
            "shape": dataclasses.asdict(bench.shape), "texts_exact": bench.texts_exact,
            "systems": system_rows, "medians": {row["name"]: report.median_metrics(row["runs"]) for row in system_rows},
            "ratios": report.ratios(system_rows)}


def title(names: list[str], shape: ConversationShape, args) -> str:
    return (f"{' vs '.join(names)}: {shape.num_conversations} conversations x {shape.num_turns} turns at once, "
            f"a shared {shape.num_system_tokens}-token system prompt, user messages of {shape.min_user_tokens}-"
            f"{shape.max_user_tokens} tokens, {shape.num_output_tokens} output tokens per turn, think time "
            f"{args.think_time:g} s; {medians_label(args.reps)}")


def main(argv: list[str] | None = None, prog: str | None = None,
         default_output: Path = Path("multi_turn.json")) -> int:
    """Run the benchmark; results go to --output (default `default_output`) and its .md beside it."""
    args = build_parser(prog, default_output).parse_args(argv)
    results = run_and_write("multi-turn", args, run_benchmark,
                            lambda results: report.table(results["systems"], results["ratios"]))
    return 0 if results is not None else 1


if __name__ == "__main__":
    sys.exit(main())
