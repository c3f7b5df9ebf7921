"""What every serving benchmark (serve, multi_turn, long_prompt) does alike: the target flags,
connecting to an endpoint, building prompts, warming a server up, starting each --system per
repetition, the results' header and writing the results beside their table."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import httpx

from benchmarks.load.client import Endpoint, EndpointError, check_endpoint
from benchmarks.load.prompts import PromptBuilder, RemoteTokenCounter
from benchmarks.load.runner import run_requests
from benchmarks.load.systems import RunningSystem, SystemSpec, SystemStartError
from benchmarks.load.workload import RequestSpec

API_KEY_ENVS = ("OPENAI_API_KEY", "TANDEM_API_KEY")
WARMUP_INPUT_TOKENS, WARMUP_OUTPUT_TOKENS = 16, 4

# measures one repetition against the endpoint at a url: (url, system name, rep) -> runs
Measure = Callable[[str, str, int], list[dict]]


class BenchmarkError(RuntimeError):
    """A run that cannot go on (every request failed); the message says why."""


def add_target_args(ap: argparse.ArgumentParser, system_help: str) -> argparse._ArgumentGroup:
    """The "target" group: a running endpoint or --system commands to start; returned so a
    benchmark can add its own target flags."""
    target = ap.add_argument_group("target")
    target.add_argument("--base-url", default="http://127.0.0.1:8000", help="a running endpoint")
    target.add_argument("--system", action="append", default=[], metavar="NAME=COMMAND", help=system_help)
    target.add_argument("--model", default=None, help="model name to send (default: the first in /v1/models)")
    target.add_argument("--api-key", default=next((os.environ[e] for e in API_KEY_ENVS if e in os.environ), None))
    target.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (a vLLM extension)")
    target.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for a --system to be healthy")
    target.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "tandem-bench",
                        help="where each --system's output goes (NAME.log)")
    return target


def add_median_run_args(ap: argparse.ArgumentParser, default_output: Path, *, request_timeout_s: float,
                        unit: str) -> argparse._ArgumentGroup:
    """The "run" group of a benchmark that reports medians over repetitions of one run; `unit`
    names what it sends (a request, a turn). Returned so a benchmark can add its own run flags."""
    run = ap.add_argument_group("run")
    run.add_argument("--reps", type=int, default=1, help="repetitions (interleaved across systems; medians reported)")
    run.add_argument("--warmup", type=int, default=2, help="unrecorded short requests after each start")
    run.add_argument("--request-timeout", type=float, default=request_timeout_s,
                     help=f"seconds before a {unit} counts as failed")
    run.add_argument("--output", type=Path, default=default_output)
    run.add_argument("--save-requests", action="store_true", help=f"keep every {unit}'s record in the JSON")
    run.add_argument("--no-progress", action="store_true")
    return run


@contextmanager
def connect(url: str, args, kind: str) -> Iterator[tuple[httpx.Client, Endpoint]]:
    """A client for the endpoint at `url` and the Endpoint to send `kind` requests to (the model
    checked against its /v1/models)."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=url, headers=headers, timeout=args.request_timeout) as http:
        model = check_endpoint(http, args.model)
        yield http, Endpoint(url, model, kind, args.api_key, not args.no_ignore_eos)


def prompt_builder(http: httpx.Client, model: str, *, chat: bool, seed: int, what: str = "prompt") -> PromptBuilder:
    """A builder measuring texts with the server's /tokenize, or approximating (a word taken as a
    token) where that is not usable; `what` names the texts in the note saying so."""
    try:
        return PromptBuilder(RemoteTokenCounter(http, model, chat), seed)
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        print(f"note: {http.base_url}tokenize is not usable ({type(exc).__name__}); {what} lengths "
              f"are approximate (a word taken as a token)", file=sys.stderr)
        return PromptBuilder(None, seed)


def warm_up(endpoint: Endpoint, prompts: dict[int, str], request_timeout_s: float) -> None:
    """Unrecorded requests, one at a time, so a run does not pay a server's first-request costs."""
    if not prompts:
        return
    specs = [RequestSpec(i, WARMUP_INPUT_TOKENS, WARMUP_OUTPUT_TOKENS) for i in prompts]
    records = asyncio.run(run_requests(endpoint, specs, prompts, concurrency=1, request_timeout_s=request_timeout_s,
                                       max_duration_s=request_timeout_s, progress=False))
    failed = [r for r in records if not r.ok]
    if failed:
        raise BenchmarkError(f"warm-up requests to {endpoint.base_url}{endpoint.path} failed: "
                             f"{failed[0].error}: {failed[0].error_message}")


def run_systems(args, measure: Measure) -> tuple[list[str], list[dict]]:
    """Every repetition against --base-url, or against each --system started afresh (A B C, then
    C B A, so drift hits all alike). Returns the system names and a row per system: its name, its
    command (or the url) and its runs."""
    systems = [SystemSpec.parse(s) for s in args.system]
    names = [s.name for s in systems] or ["target"]
    if len(set(names)) != len(names):
        raise ValueError(f"system names must differ: {names}")
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for rep in range(args.reps):
        if not systems:
            runs["target"] += measure(args.base_url, "target", rep)
            continue
        for spec in (systems if rep % 2 == 0 else systems[::-1]):
            with RunningSystem(spec, args.log_dir / f"{spec.name}.log").start(args.startup_timeout) as running:
                runs[spec.name] += measure(running.url, spec.name, rep)
    rows = [{"name": name, "command": next((s.command for s in systems if s.name == name), args.base_url),
             "runs": runs[name]} for name in names]
    return names, rows


def machine_label() -> str:
    """The machine as a title ends with it."""
    return f"{platform.machine()} {os.cpu_count()} CPUs"


def medians_label(num_reps: int) -> str:
    """How many repetitions a median is over, and the machine, as a title ends with them."""
    reps = f"median of {num_reps} repetitions" if num_reps > 1 else "one repetition"
    return f"{reps}, {machine_label()}"


def run_info(args) -> dict:
    """When, on what machine and with which arguments (the API key left out) a benchmark ran."""
    return {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                        "cpus": os.cpu_count()},
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "api_key"}}


def write_results(output: Path, results: dict, table: str) -> None:
    """Print the table; the results go to `output` as JSON and the titled table beside it as .md,
    which benchmarks/update_benchmarks_doc.py puts into docs/benchmarks.md."""
    print(table)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=1))
    output.with_suffix(".md").write_text(f"{results['title']}\n\n{table}\n")
    print(f"\nwrote {output}", file=sys.stderr)


def run_and_write(label: str, args, run_benchmark: Callable[..., dict], make_table: Callable[[dict], str],
                  errors: tuple[type[Exception], ...] = ()) -> dict | None:
    """Run the benchmark and write its results with `write_results`; on an error the run cannot
    survive (also any of `errors`), say so and return None."""
    try:
        results = run_benchmark(args)
    except (EndpointError, SystemStartError, BenchmarkError, ValueError, *errors) as exc:
        print(f"{label} benchmark: error: {exc}", file=sys.stderr)
        return None
    write_results(args.output, results, make_table(results))
    return results
