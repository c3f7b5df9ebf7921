"""Serving benchmark for any OpenAI-compatible endpoint: load-latency sweeps and side-by-side runs.

Drives /v1/completions or /v1/chat/completions with streaming and records, per request, TTFT,
inter-token latencies, TPOT, end-to-end latency and Neo's per-token latency (latency / output
tokens), with token counts from the server's usage. Each load level (a Poisson rate, a closed-loop
concurrency, all at once, or a CSV replay) gives throughputs, p50/p90/p99 and goodput under SLOs;
the results go to JSON and a load-latency PNG with one curve per system.

Against a running server:
    tandem bench serve --base-url http://127.0.0.1:8000 --rate 1 2 4 --num-requests 32
Side by side, each system started from its command line ({port} is filled in), repetitions
interleaved (A B, then B A) so drift hits both alike; ratios are against the first system:
    tandem bench serve --rate 1 2 4 --reps 3 \\
        --system 'seqs8=tandem serve --port {port} --max-num-seqs 8' \\
        --system 'seqs32=tandem serve --port {port} --max-num-seqs 32'
Workloads: --input-len/--output-len/--length-spread (synthetic; 0.1 is Neo's +-10%),
--workload chat|code-completion|summarization|FILE.json, or --replay trace.csv.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import sys
import time
from pathlib import Path

import httpx

from benchmarks.load.client import Endpoint, max_model_len, server_counters, settled_counters
from benchmarks.load.harness import (WARMUP_INPUT_TOKENS, BenchmarkError, add_target_args, connect, machine_label,
                                  prompt_builder, run_and_write, run_info, run_systems, warm_up)
from benchmarks.load.report import ratio_table, ratios, run_table
from benchmarks.load.runner import run_requests
from benchmarks.load.stats import SLO_METRICS, summarize
from benchmarks.load.workload import (Load, RequestSpec, WorkloadError, WorkloadFile,
                                         read_replay_csv, synthetic_lengths, workload_lengths)

DEFAULT_NUM_REQUESTS = 64


def build_parser(prog: str | None = None, default_output: Path = Path("serve.json")) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = add_target_args(ap, "start this system per repetition instead (repeatable; the first is the baseline)")
    target.add_argument("--endpoint", choices=["completions", "chat"], default=None,
                        help="default: the workload file's, else completions")
    load = ap.add_argument_group("load (one of; a list sweeps)")
    kinds = load.add_mutually_exclusive_group()
    kinds.add_argument("--rate", type=float, nargs="+", help="Poisson arrivals at these req/s (inf: all at once)")
    kinds.add_argument("--concurrency", type=int, nargs="+", help="closed loop with these numbers of clients")
    kinds.add_argument("--all-at-once", action="store_true", help="send every request at t=0 (the default)")
    work = ap.add_argument_group("workload")
    work.add_argument("--num-requests", type=int, default=None, help=f"per level (default {DEFAULT_NUM_REQUESTS}; replay: all rows)")
    work.add_argument("--input-len", type=int, default=128)
    work.add_argument("--output-len", type=int, default=64)
    work.add_argument("--length-spread", type=float, default=0.1,
                      help="synthetic lengths uniform within +-this fraction (0: fixed)")
    work.add_argument("--output-spread", type=float, default=None,
                      help="the outputs' own spread (default: --length-spread)")
    work.add_argument("--workload", default=None, help="a lognormal mix: a name in configs/workloads/ or a .json")
    work.add_argument("--replay", default=None, metavar="CSV",
                      help="(arrival s, input tokens, output tokens) rows; --rate rescales the arrivals")
    work.add_argument("--seed", type=int, default=0)
    run = ap.add_argument_group("run")
    run.add_argument("--reps", type=int, default=1, help="repetitions (interleaved across systems)")
    run.add_argument("--warmup", type=int, default=2, help="unrecorded requests before each system's runs")
    run.add_argument("--reuse-prompts", action="store_true",
                     help="send the same prompts at every level and repetition (default: fresh ones each "
                          "time, so a server's prefix or prompt cache cannot answer from an earlier run)")
    run.add_argument("--slo", action="append", default=[], metavar="METRIC=SECONDS",
                     help=f"for goodput; METRIC in {', '.join(SLO_METRICS)} (repeatable)")
    run.add_argument("--request-timeout", type=float, default=300.0, help="seconds before a request counts as failed")
    run.add_argument("--max-duration", type=float, default=600.0, help="seconds after which a level sends no more")
    run.add_argument("--output", type=Path, default=default_output)
    run.add_argument("--plot", type=Path, default=None, help="default: the --output path with .png")
    run.add_argument("--no-plot", action="store_true")
    run.add_argument("--save-requests", action="store_true", help="keep every request's record in the JSON")
    run.add_argument("--no-progress", action="store_true")
    return ap


def parse_slos(items: list[str]) -> dict[str, float]:
    slos = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--slo takes METRIC=SECONDS with METRIC in {SLO_METRICS}, got '{item}'")
        slos[name] = float(value)
    return slos


def make_workload(args) -> tuple[list[RequestSpec], str, str]:
    """The requests (lengths, and replay times), a description, and the endpoint kind to use."""
    if args.replay:
        specs = read_replay_csv(args.replay, args.num_requests)
        return specs, f"replay of {Path(args.replay).name}", args.endpoint or "completions"
    n = args.num_requests or DEFAULT_NUM_REQUESTS
    if args.workload:
        workload = WorkloadFile.load(args.workload)
        return workload_lengths(workload, n, args.seed), f"{workload.name} mix", args.endpoint or workload.endpoint
    specs = synthetic_lengths(n, args.input_len, args.output_len, args.length_spread, args.seed, args.output_spread)

    def spread(value: float) -> str:
        return f"+-{value:.0%}" if value else "fixed"

    out_spread = args.length_spread if args.output_spread is None else args.output_spread
    title = f"in {args.input_len} ({spread(args.length_spread)}) / out {args.output_len} ({spread(out_spread)}) tokens"
    return specs, title, args.endpoint or "completions"


def make_loads(args) -> list[Load]:
    if args.concurrency:
        return [Load("concurrency", c) for c in args.concurrency]
    if args.rate:
        if args.replay:
            return [Load("replay", r) for r in args.rate]
        return [Load("burst") if math.isinf(r) else Load("rate", r) for r in args.rate]
    return [Load("replay")] if args.replay else [Load("burst")]


def clip_to_context(specs: list[RequestSpec], limit: int | None) -> tuple[list[RequestSpec], int]:
    """Shorten prompts (then outputs) so prompt + output fits the context; returns the count clipped."""
    if limit is None:
        return specs, 0
    clipped, out = 0, []
    for s in specs:
        num_output = min(s.num_output_tokens, limit - 1)
        num_input = min(s.num_input_tokens, limit - num_output)
        clipped += (num_input, num_output) != (s.num_input_tokens, s.num_output_tokens)
        out.append(dataclasses.replace(s, num_input_tokens=num_input, num_output_tokens=num_output))
    return out, clipped


class Bench:
    """Holds what stays fixed across systems and repetitions: requests, loads, prompts per system."""

    def __init__(self, args, specs: list[RequestSpec], endpoint_kind: str) -> None:
        self.args, self.specs, self.endpoint_kind = args, specs, endpoint_kind
        self.loads = make_loads(args)
        self.slos = parse_slos(args.slo)
        # name -> (per run: request index -> prompt, warm-up prompts, info)
        self.prompts: dict[str, tuple[list[dict[int, str]], dict[int, str], dict]] = {}
        self.context_checked = False

    def measure(self, url: str, name: str, rep: int) -> list[dict]:
        """Every load level once against the endpoint at `url`."""
        args = self.args
        with connect(url, args, self.endpoint_kind) as (http, endpoint):
            if not self.context_checked:  # the first system's context length fixes the workload for all
                self.specs, num_clipped = clip_to_context(self.specs, max_model_len(http, endpoint.model))
                if num_clipped:
                    print(f"note: {num_clipped} requests shortened to fit the context length", file=sys.stderr)
                self.context_checked = True
            if name not in self.prompts:
                self.prompts[name] = self._build_prompts(http, endpoint)
            prompts, warmup_prompts, prompt_info = self.prompts[name]
            warm_up(endpoint, warmup_prompts, args.request_timeout)
            runs = [self._run_level(http, endpoint, name, rep, load, prompts[self._run_index(rep, level)])
                    for level, load in enumerate(self.loads)]
        for run in runs:
            run["prompts"] = prompt_info
        return runs

    def _build_prompts(self, http: httpx.Client, endpoint: Endpoint):
        builder = prompt_builder(http, endpoint.model, chat=endpoint.kind == "chat", seed=self.args.seed)
        first_warmup = len(self.specs)
        warmup = {first_warmup + i: builder.build(first_warmup + i, WARMUP_INPUT_TOKENS).text
                  for i in range(self.args.warmup)}
        # Each run's prompts drawn at their own indices, past the warm-up's: the same texts for
        # every system, none repeated from an earlier level or repetition.
        stride = first_warmup + self.args.warmup
        num_runs = 1 if self.args.reuse_prompts else self.args.reps * len(self.loads)
        built = [[builder.build(s.index + run * stride, s.num_input_tokens) for s in self.specs]
                 for run in range(num_runs)]
        every = [p for run in built for p in run]
        info = {"exact": builder.counter is not None and all(p.exact for p in every),
                "num_inexact": sum(not p.exact for p in every), "fresh_per_run": not self.args.reuse_prompts}
        if builder.counter is not None and info["num_inexact"]:
            print(f"note: {info['num_inexact']} prompts missed their exact token count", file=sys.stderr)
        return [{s.index: p.text for s, p in zip(self.specs, run)} for run in built], warmup, info

    def _run_index(self, rep: int, level: int) -> int:
        """Which of a system's prompt sets a (repetition, level) run sends."""
        return 0 if self.args.reuse_prompts else rep * len(self.loads) + level

    def _run_level(self, http: httpx.Client, endpoint: Endpoint, name: str, rep: int, load: Load,
                   prompts: dict[int, str]) -> dict:
        args = self.args
        started_at, cpu_at_start = time.time(), time.process_time()
        before = server_counters(http)
        records = asyncio.run(run_requests(
            endpoint, load.schedule(self.specs, args.seed), prompts, concurrency=load.concurrency,
            request_timeout_s=args.request_timeout, max_duration_s=args.max_duration,
            description=f"{name} {load.label}" + (f" rep {rep}" if args.reps > 1 else ""),
            progress=not args.no_progress))
        client_cpu_s = time.process_time() - cpu_at_start  # the harness shares the machine it measures
        summary = summarize(records, self.slos)
        after = settled_counters(http, before, summary["num_succeeded"])
        if summary["num_sent"] and not summary["num_succeeded"]:
            raise BenchmarkError(f"every request to {endpoint.base_url}{endpoint.path} failed "
                                 f"({summary['errors']}); first: {summary['first_error']}")
        if summary["num_failed"]:
            print(f"warning: {name} {load.label}: {summary['num_failed']} of {summary['num_sent']} requests "
                  f"failed {summary['errors']}; first: {summary['first_error']}", file=sys.stderr)
        sent = [r for r in records if r.start_s is not None]
        run = {"rep": rep, "started_at": started_at, "client_cpu_s": client_cpu_s,
               "load": {"kind": load.kind, "value": load.value, "label": load.label},
               "summary": summary,
               "targets": {"num_prompt_tokens": sum(r.num_target_input_tokens for r in sent),
                           "num_output_tokens": sum(r.num_target_output_tokens for r in sent)},
               "server_counters": ({k: after[k] - before.get(k, 0.0) for k in after}
                                   if before is not None and after is not None else None)}
        _check_counters(name, load, run)
        if args.save_requests:
            run["requests"] = [dataclasses.asdict(r) for r in records]
        return run


def _check_counters(name: str, load: Load, run: dict) -> None:
    """Warn when the server's /metrics deltas disagree with the usage the harness received."""
    counters, summary = run["server_counters"], run["summary"]
    if not counters or summary["num_failed"]:
        return  # failed requests may have computed tokens no usage reports
    pairs = (("generation_tokens", summary["num_output_tokens"]), ("prompt_tokens", summary["num_prompt_tokens"]),
             ("request_success", summary["num_succeeded"]))
    for key, harness in pairs:
        if key in counters and counters[key] != harness:
            print(f"warning: {name} {load.label}: /metrics counted {counters[key]:g} {key}, the usage "
                  f"the harness received says {harness}", file=sys.stderr)


def run_benchmark(args) -> dict:
    specs, description, endpoint_kind = make_workload(args)
    bench = Bench(args, specs, endpoint_kind)
    names, system_rows = run_systems(args, bench.measure)
    results = {
        "benchmark": "serve",
        "title": f"{' vs '.join(names)}: {description}, {len(bench.specs)} requests per level, "
                 f"{bench.endpoint_kind}, {machine_label()}",
        **run_info(args),
        "workload": {"description": description, "endpoint": bench.endpoint_kind,
                     "num_requests": len(bench.specs),
                     "input_tokens": [s.num_input_tokens for s in bench.specs],
                     "output_tokens": [s.num_output_tokens for s in bench.specs]},
        "load_kind": bench.loads[0].kind,
        "systems": system_rows,
    }
    results["ratios"] = ratios(results)
    return results


def results_table(results: dict) -> str:
    """Every run's row, then the ratios to the first system where there are several."""
    table = run_table(results)
    if results["ratios"]:
        table += "\n\nRatios to the first system (median [min-max] over repetitions):\n\n"
        table += ratio_table(results["ratios"])
    return table


def main(argv: list[str] | None = None, prog: str | None = None, default_output: Path = Path("serve.json")) -> int:
    """Run the benchmark; results go to --output (default `default_output`) and beside it."""
    args = build_parser(prog, default_output).parse_args(argv)
    results = run_and_write("serve", args, run_benchmark, results_table, errors=(WorkloadError,))
    if results is None:
        return 1
    if not args.no_plot:
        from benchmarks.load.plot import plot_load_latency
        path = plot_load_latency(results, args.plot or args.output.with_suffix(".png"))
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
