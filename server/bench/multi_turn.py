"""Multi-turn chat benchmark: what a chat frontend or an agent sees from a server's prefix cache.

Conversations over one shared system prompt (server/bench/conversation.py) run concurrently
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

    python benchmarks/multi_turn.py --reps 3 \\
        --system 'tandem=tandem serve --port {port} --quantization int4' \\
        --system 'vllm=python -m vllm.entrypoints.openai.api_server --port {port} --enable-prefix-caching ...'
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import httpx

from server.bench import multi_turn_report as report
from server.bench.client import (Endpoint, EndpointError, RequestRecord, check_endpoint, max_model_len,
                                 server_counters, settled_counters)
from server.bench.conversation import (Conversation, ConversationShape, build_conversations,
                                       run_conversations)
from server.bench.prompts import PromptBuilder, RemoteTokenCounter
from server.bench.serve import API_KEY_ENVS, WARMUP_INPUT_TOKENS, BenchmarkError, warm_up
from server.bench.stats import summarize
from server.bench.systems import RunningSystem, SystemSpec, SystemStartError

TEMPLATE_TOKENS_PER_MESSAGE = 8  # a chat template's role markers, allowed for when checking the context


def build_parser(prog: str | None = None, default_output: Path = Path("multi_turn.json")) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = ap.add_argument_group("target")
    target.add_argument("--base-url", default="http://127.0.0.1:8000", help="a running endpoint")
    target.add_argument("--system", action="append", default=[], metavar="NAME=COMMAND",
                        help="start this system per repetition instead (repeatable; the first is the baseline)")
    target.add_argument("--model", default=None, help="model name to send (default: the first in /v1/models)")
    target.add_argument("--api-key", default=next((os.environ[e] for e in API_KEY_ENVS if e in os.environ), None))
    target.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (a vLLM extension)")
    target.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for a --system to be healthy")
    target.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "tandem-bench",
                        help="where each --system's output goes (NAME.log)")
    work = ap.add_argument_group("conversations")
    work.add_argument("--num-conversations", type=int, default=16, help="all run at once")
    work.add_argument("--num-turns", type=int, default=6, help="per conversation, in order")
    work.add_argument("--system-prompt-len", type=int, default=400, help="tokens of the shared system prompt")
    work.add_argument("--user-len", type=int, nargs=2, default=[60, 100], metavar=("MIN", "MAX"),
                      help="tokens of each user message, uniform in [MIN, MAX]")
    work.add_argument("--output-len", type=int, default=64, help="tokens of each reply")
    work.add_argument("--think-time", type=float, default=0.0, help="seconds between a reply and the next turn")
    work.add_argument("--seed", type=int, default=0)
    run = ap.add_argument_group("run")
    run.add_argument("--reps", type=int, default=1, help="repetitions (interleaved across systems; medians reported)")
    run.add_argument("--warmup", type=int, default=2, help="unrecorded short requests after each start")
    run.add_argument("--request-timeout", type=float, default=300.0, help="seconds before a turn counts as failed")
    run.add_argument("--max-duration", type=float, default=1800.0, help="seconds after which no turn is sent")
    run.add_argument("--output", type=Path, default=default_output)
    run.add_argument("--save-requests", action="store_true", help="keep every turn's record in the JSON")
    run.add_argument("--no-progress", action="store_true")
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
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        with httpx.Client(base_url=url, headers=headers, timeout=args.request_timeout) as http:
            model = check_endpoint(http, args.model)
            endpoint = Endpoint(url, model, "chat", args.api_key, not args.no_ignore_eos)
            self._check_context(name, max_model_len(http, model))
            if self.conversations is None:
                self._build_texts(http, model)
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
        try:
            builder = PromptBuilder(RemoteTokenCounter(http, model, chat=False), self.args.seed)
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            print(f"note: /tokenize is not usable ({type(exc).__name__}); message lengths are approximate "
                  f"(a word taken as a token)", file=sys.stderr)
            builder = PromptBuilder(None, self.args.seed)
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
    systems = [SystemSpec.parse(s) for s in args.system]
    names = [s.name for s in systems] or ["target"]
    if len(set(names)) != len(names):
        raise ValueError(f"system names must differ: {names}")
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for rep in range(args.reps):
        if not systems:
            runs["target"].append(bench.measure(args.base_url, "target", rep))
            continue
        for spec in (systems if rep % 2 == 0 else systems[::-1]):  # A B C, then C B A: drift hits all alike
            with RunningSystem(spec, args.log_dir / f"{spec.name}.log").start(args.startup_timeout) as running:
                runs[spec.name].append(bench.measure(running.url, spec.name, rep))
    system_rows = [{"name": name, "command": next((s.command for s in systems if s.name == name), args.base_url),
                    "runs": runs[name]} for name in names]
    return {"benchmark": "multi_turn", "title": title(names, bench.shape, args),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                        "cpus": os.cpu_count()},
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "api_key"},
            "shape": dataclasses.asdict(bench.shape), "texts_exact": bench.texts_exact,
            "systems": system_rows, "medians": {row["name"]: report.median_metrics(row["runs"]) for row in system_rows},
            "ratios": report.ratios(system_rows)}


def title(names: list[str], shape: ConversationShape, args) -> str:
    reps = f"median of {args.reps} repetitions" if args.reps > 1 else "one repetition"
    return (f"{' vs '.join(names)}: {shape.num_conversations} conversations x {shape.num_turns} turns at once, "
            f"a shared {shape.num_system_tokens}-token system prompt, user messages of {shape.min_user_tokens}-"
            f"{shape.max_user_tokens} tokens, {shape.num_output_tokens} output tokens per turn, think time "
            f"{args.think_time:g} s; {reps}, {platform.machine()} {os.cpu_count()} CPUs")


def main(argv: list[str] | None = None, prog: str | None = None,
         default_output: Path = Path("multi_turn.json")) -> int:
    """Run the benchmark; results go to --output (default `default_output`) and its .md beside it."""
    args = build_parser(prog, default_output).parse_args(argv)
    try:
        results = run_benchmark(args)
    except (EndpointError, SystemStartError, BenchmarkError, ValueError) as exc:
        print(f"multi-turn benchmark: error: {exc}", file=sys.stderr)
        return 1
    table = report.table(results["systems"], results["ratios"])
    print(table)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=1))
    # the table docs/benchmarks.md shows (benchmarks/update_benchmarks_doc.py puts it there)
    args.output.with_suffix(".md").write_text(f"{results['title']}\n\n{table}\n")
    print(f"\nwrote {args.output}", file=sys.stderr)
    return 0
