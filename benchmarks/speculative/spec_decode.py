"""Speculative decoding side by side: what drafts buy where the output copies its input and where
it does not, each server with and without its own speculation.

Two workloads of chat requests, greedy, ending where the model ends them (no ignore_eos):
  copy   passages of the held text to repeat word for word, to summarise quoting them, and this
         repository's Python functions to rewrite with their comments removed: the output
         repeats the prompt, which is what n-gram lookup drafts from;
  chat   open questions: little of the output is in the prompt.
Each at 1 client (requests one after another) and at --clients (all at once). Reported per
system, medians over repetitions (each system started afresh per repetition, A B C then C B A):
output tokens/s (the prompt's prefill included) and TPOT p50 (decode alone), each speculating
system's ratios to its own baseline (the system with its name less the suffix -ngram or -draft), and how
many of its texts equal the baseline's (the first repetition's).

    python -m benchmarks.speculative.spec_decode --reps 3 \\
        --system 'tandem=tandem serve --port {port}' \\
        --system 'tandem-ngram=tandem serve --port {port} --speculative-config {"method":"ngram",...}'
"""
from __future__ import annotations

import argparse
import ast
import asyncio
import statistics
import sys
from pathlib import Path

from benchmarks.load.client import Endpoint
from benchmarks.load.harness import (add_median_run_args, add_target_args, connect, medians_label, run_and_write,
                                     run_info, run_systems, warm_up)
from benchmarks.load.runner import run_requests
from benchmarks.load.stats import summarize
from benchmarks.load.workload import RequestSpec

REPO = Path(__file__).resolve().parents[2]
HELD_TEXT = REPO / "tests" / "data" / "held_text.txt"
CODE_FILES = ("scheduler/scheduler.py", "scheduler/block_pool.py", "scheduler/prefix_cache.py",
              "engine/runtime/batch.py", "engine/speculative/budget.py")
CHAT_QUESTIONS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a rainbow forms, for a ten-year-old.",
    "What are three good habits for learning a new language?",
    "Describe your ideal weekend in a small mountain town.",
    "Give me a recipe idea for a quick vegetarian dinner.",
    "Why do cats purr? Answer in a paragraph.",
    "Write a poem about autumn leaves.",
    "What should I pack for a week-long hiking trip?",
)
SPECULATING_SUFFIXES = ("-ngram", "-draft")


def build_parser(prog: str | None = None, default_output: Path = Path("spec_decode.json")) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_args(ap, "start this system per repetition instead (repeatable)")
    work = ap.add_argument_group("requests")
    work.add_argument("--num-requests", type=int, default=8, help="requests per workload at one client")
    work.add_argument("--clients", type=int, default=32, help="the crowded level's clients (0: none)")
    work.add_argument("--max-tokens", type=int, default=160)
    add_median_run_args(ap, default_output, request_timeout_s=600.0, unit="request")
    return ap


# ---- the prompts ----------------------------------------------------------------------------------
def passages(num: int, min_words: int = 60, max_words: int = 110) -> list[str]:
    """Paragraphs of the held text of about 60-110 words, in order."""
    found = []
    for paragraph in HELD_TEXT.read_text().split("\n\n"):
        words = paragraph.split()
        if min_words <= len(words) <= max_words:
            found.append(" ".join(words))
        if len(found) == num:
            break
    return found


def functions(num: int, min_lines: int = 8, max_lines: int = 24) -> list[str]:
    """Python functions of this repository of 8-24 lines, with their comments."""
    found = []
    for name in CODE_FILES:
        source = (REPO / name).read_text()
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef) and min_lines <= node.end_lineno - node.lineno + 1 <= max_lines:
                found.append("\n".join(lines[node.lineno - 1:node.end_lineno]))
    return found[:num]


def copy_prompts(num: int) -> list[str]:
    texts, code = passages(num), functions(num)
    kinds = [lambda i: f"Repeat the following passage exactly, word for word:\n\n{texts[i % len(texts)]}",
             lambda i: f"Summarise this passage, quoting its key sentences word for word:\n\n{texts[-1 - i % len(texts)]}",
             lambda i: f"Rewrite this Python function with its comments removed, otherwise unchanged:\n\n"
                       f"```python\n{code[i % len(code)]}\n```"]
    return [kinds[i % len(kinds)](i) for i in range(num)]


def chat_prompts(num: int) -> list[str]:
    return [CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)] + ("" if i < len(CHAT_QUESTIONS) else f" (take {i})")
            for i in range(num)]


WORKLOADS = {"copy": copy_prompts, "chat": chat_prompts}


# ---- a run --------------------------------------------------------------------------------------------
def levels(args) -> list[tuple[str, int, int]]:
    """(workload, clients, requests) for every measured level."""
    crowded = [(name, args.clients, args.clients) for name in WORKLOADS] if args.clients else []
    return [(name, 1, args.num_requests) for name in WORKLOADS] + crowded


def measure(args, url: str, name: str, rep: int) -> list[dict]:
    with connect(url, args, "chat") as (http, endpoint):
        endpoint = Endpoint(endpoint.base_url, endpoint.model, "chat", endpoint.api_key, ignore_eos=False)
        warm_up(endpoint, {i: f"Say hello number {i}." for i in range(args.warmup)}, args.request_timeout)
        runs = []
        for workload, clients, num in levels(args):
            prompts = dict(enumerate(WORKLOADS[workload](num)))
            specs = [RequestSpec(i, 0, args.max_tokens) for i in prompts]
            records = asyncio.run(run_requests(endpoint, specs, prompts, concurrency=clients,
                                               request_timeout_s=args.request_timeout,
                                               max_duration_s=args.request_timeout, description=f"{name} {workload}",
                                               progress=not args.no_progress))
            summary = summarize(records)
            if summary["num_failed"]:
                print(f"warning: {name} {workload} x{clients}: {summary['num_failed']} failed: "
                      f"{summary['first_error']}", file=sys.stderr)
            runs.append({"rep": rep, "workload": workload, "clients": clients,
                         "output_throughput": summary["output_throughput"],
                         "tpot_p50": (summary["tpot"] or {}).get("p50"),
                         "num_output_tokens": summary["num_output_tokens"],
                         "texts": [r.output_text for r in sorted(records, key=lambda r: r.index)]})
        return runs


def run_benchmark(args) -> dict:
    names, rows = run_systems(args, lambda url, name, rep: measure(args, url, name, rep))
    return {"benchmark": "spec_decode", "title": title(names, args), **run_info(args), "systems": rows,
            "levels": [list(level) for level in levels(args)]}


# ---- the report ----------------------------------------------------------------------------------------
def baseline_of(name: str, names: list[str]) -> str | None:
    for suffix in SPECULATING_SUFFIXES:
        if name.endswith(suffix) and name[:-len(suffix)] in names:
            return name[:-len(suffix)]
    return None


def median_of(runs: list[dict], workload: str, clients: int, key: str) -> float | None:
    values = [r[key] for r in runs if r["workload"] == workload and r["clients"] == clients and r[key] is not None]
    return statistics.median(values) if values else None


def table(results: dict) -> str:
    rows = {row["name"]: row["runs"] for row in results["systems"]}
    names = list(rows)
    lines = ["| system | workload | clients | output tokens/s | x baseline | TPOT p50 ms | decode x baseline "
             "| texts as baseline's |", "|---|---|---|---|---|---|---|---|"]
    for workload, clients, _ in results["levels"]:
        for name in names:
            rate = median_of(rows[name], workload, clients, "output_throughput")
            tpot = median_of(rows[name], workload, clients, "tpot_p50")
            base = baseline_of(name, names)
            ratio = decode_ratio = same = "-"
            if base is not None:
                base_rate = median_of(rows[base], workload, clients, "output_throughput")
                base_tpot = median_of(rows[base], workload, clients, "tpot_p50")
                ratio = f"{rate / base_rate:.2f}x" if rate and base_rate else "-"
                decode_ratio = f"{base_tpot / tpot:.2f}x" if tpot and base_tpot else "-"
                same = _same_texts(rows[name], rows[base], workload, clients)
            lines.append(f"| {name} | {workload} | {clients} | {_fmt(rate, '.1f')} | {ratio} | "
                         f"{_fmt(tpot and tpot * 1e3, '.1f')} | {decode_ratio} | {same} |")
    return "\n".join(lines)


def _same_texts(runs: list[dict], base_runs: list[dict], workload: str, clients: int) -> str:
    mine = [r["texts"] for r in runs if r["workload"] == workload and r["clients"] == clients]
    theirs = [r["texts"] for r in base_runs if r["workload"] == workload and r["clients"] == clients]
    if not mine or not theirs:
        return "-"
    equal = sum(a == b for a, b in zip(mine[0], theirs[0]))
    return f"{equal}/{len(mine[0])}"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def title(names: list[str], args) -> str:
    return (f"{' vs '.join(names)}: chat requests copying their prompt (passages, summaries, code) and open chat, "
            f"greedy, up to {args.max_tokens} tokens, at 1 client and {args.clients}; {medians_label(args.reps)}")


def main(argv: list[str] | None = None, prog: str | None = None,
         default_output: Path = Path("spec_decode.json")) -> int:
    args = build_parser(prog, default_output).parse_args(argv)
    return 0 if run_and_write("spec-decode", args, run_benchmark, table) is not None else 1


if __name__ == "__main__":
    sys.exit(main())
