"""Long-prompt benchmark: what running streams see while a server prefills a long prompt.

A chat frontend or an agent keeps several streams decoding when a request with a long prompt (a
document, a long context) arrives. A server that prefills it in one iteration stops every stream
for the whole prefill; one that prefills it in chunks between decode steps (tandem's
--max-num-batched-tokens) keeps them going and pays in the long prompt's TTFT. The run
(server/bench/long_prompt_scenario.py): --num-streams streamed completions with short prompts and
long outputs (ignore_eos, as in `tandem bench serve`); once each has --tokens-before-arrival
tokens, one streamed request with a --long-prompt-tokens prompt. Reported per system, medians over
repetitions (server/bench/long_prompt_report.py): the running streams' ITL p50/p99/max from the
long prompt's send until its first token, their ITL before it arrived, their TPOT p50 over the
whole run, ITL p99 / TPOT p50 (the target: at most 3), and the long prompt's TTFT.

Each --system is started afresh for every repetition (A B C, then C B A, so drift hits all alike);
every repetition has its own texts (measured with the first system's /tokenize), the same for
every system, so no prompt is answered from a prefix cache.

    python benchmarks/long_prompt.py --reps 3 \\
        --system 'chunked=tandem serve --port {port} --max-model-len 8192' \\
        --system 'unchunked=tandem serve --port {port} --max-model-len 8192 --max-num-batched-tokens 8192'
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

from server.bench import long_prompt_report as report
from server.bench.client import Endpoint, EndpointError, check_endpoint, max_model_len
from server.bench.long_prompt_scenario import LongPromptShape, LongPromptTexts, build_texts, run_long_prompt
from server.bench.prompts import PromptBuilder, RemoteTokenCounter
from server.bench.serve import API_KEY_ENVS, WARMUP_INPUT_TOKENS, BenchmarkError, warm_up
from server.bench.systems import RunningSystem, SystemSpec, SystemStartError


def build_parser(prog: str | None = None, default_output: Path = Path("long_prompt.json")) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = ap.add_argument_group("target")
    target.add_argument("--base-url", default="http://127.0.0.1:8000", help="a running endpoint")
    target.add_argument("--system", action="append", default=[], metavar="NAME=COMMAND",
                        help="start this system per repetition instead (repeatable)")
    target.add_argument("--model", default=None, help="model name to send (default: the first in /v1/models)")
    target.add_argument("--api-key", default=next((os.environ[e] for e in API_KEY_ENVS if e in os.environ), None))
    target.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (a vLLM extension)")
    target.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for a --system to be healthy")
    target.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "tandem-bench",
                        help="where each --system's output goes (NAME.log)")
    work = ap.add_argument_group("requests")
    work.add_argument("--num-streams", type=int, default=8, help="streams running when the long prompt arrives")
    work.add_argument("--stream-input-len", type=int, default=64, help="tokens of each stream's prompt")
    work.add_argument("--stream-output-len", type=int, default=400, help="tokens each stream generates")
    work.add_argument("--tokens-before-arrival", type=int, default=20,
                      help="tokens every stream has received when the long prompt is sent")
    work.add_argument("--long-prompt-tokens", type=int, default=8000, help="tokens of the long prompt")
    work.add_argument("--long-output-len", type=int, default=16, help="tokens the long prompt's request generates")
    work.add_argument("--seed", type=int, default=0)
    run = ap.add_argument_group("run")
    run.add_argument("--reps", type=int, default=1, help="repetitions (interleaved across systems; medians reported)")
    run.add_argument("--warmup", type=int, default=2, help="unrecorded short requests after each start")
    run.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request counts as failed")
    run.add_argument("--output", type=Path, default=default_output)
    run.add_argument("--save-requests", action="store_true", help="keep every request's record in the JSON")
    run.add_argument("--no-progress", action="store_true")
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
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        with httpx.Client(base_url=url, headers=headers, timeout=args.request_timeout) as http:
            model = check_endpoint(http, args.model)
            endpoint = Endpoint(url, model, "completions", args.api_key, not args.no_ignore_eos)
            self._check_context(name, max_model_len(http, model))
            if self.texts is None:
                self._build_texts(http, model)
            warm_up(endpoint, self.warmup_prompts, args.request_timeout)
            return self._run(endpoint, name, rep)

    def _check_context(self, name: str, limit: int | None) -> None:
        if limit is not None and self.shape.num_max_context_tokens > limit:
            raise BenchmarkError(f"{name}: the long prompt and its output take {self.shape.num_max_context_tokens} "
                                 f"tokens, over its context of {limit}; a larger --max-model-len or a shorter "
                                 f"--long-prompt-tokens")

    def _build_texts(self, http: httpx.Client, model: str) -> None:
        try:
            builder = PromptBuilder(RemoteTokenCounter(http, model, chat=False), self.args.seed)
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            print(f"note: /tokenize is not usable ({type(exc).__name__}); prompt lengths are approximate "
                  f"(a word taken as a token)", file=sys.stderr)
            builder = PromptBuilder(None, self.args.seed)
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
    return {"benchmark": "long_prompt", "title": title(names, bench.shape, args),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                        "cpus": os.cpu_count()},
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "api_key"},
            "shape": dataclasses.asdict(bench.shape),
            "texts_exact": all(t.exact for t in bench.texts or []),
            "systems": system_rows,
            "medians": {row["name"]: report.median_metrics(row["runs"]) for row in system_rows}}


def title(names: list[str], shape: LongPromptShape, args) -> str:
    reps = f"median of {args.reps} repetitions" if args.reps > 1 else "one repetition"
    return (f"{' vs '.join(names)}: {shape.num_streams} streams ({shape.num_stream_input_tokens}-token prompts, "
            f"{shape.num_stream_output_tokens} output tokens) decoding when a {shape.num_long_prompt_tokens}-token "
            f"prompt ({shape.num_long_output_tokens} output tokens) arrives after {shape.num_tokens_before_arrival} "
            f"tokens each; {reps}, {platform.machine()} {os.cpu_count()} CPUs")


def main(argv: list[str] | None = None, prog: str | None = None,
         default_output: Path = Path("long_prompt.json")) -> int:
    """Run the benchmark; results go to --output (default `default_output`) and its .md beside it."""
    args = build_parser(prog, default_output).parse_args(argv)
    try:
        results = run_benchmark(args)
    except (EndpointError, SystemStartError, BenchmarkError, ValueError) as exc:
        print(f"long-prompt benchmark: error: {exc}", file=sys.stderr)
        return 1
    table = report.table(results["systems"])
    print(table)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=1))
    # the table docs/benchmarks.md shows (benchmarks/update_benchmarks_doc.py puts it there)
    args.output.with_suffix(".md").write_text(f"{results['title']}\n\n{table}\n")
    print(f"\nwrote {args.output}", file=sys.stderr)
    return 0
