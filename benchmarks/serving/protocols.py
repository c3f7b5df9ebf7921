"""The same request through /v1/chat/completions, /v1/messages and /v1/responses: what the two
translated protocols cost beside chat completions, whose pipeline they run.

One `tandem serve` on the embedded model; per scenario (plain text whole, the same streamed, a forced
tool call) the three endpoints get the same greedy request, in a rotating order every round (so drift
favours none), after a warm-up round that puts the prompt in the prefix cache for all three alike.
Latency is send to the last byte of the body or stream; the table shows medians with min-max and each
protocol's median over chat's. Run as `python -m benchmarks.serving.protocols` (`make bench-protocols`);
the table lands in docs/benchmarks.md through update_benchmarks_doc.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.load.harness import machine_label
from benchmarks.load.systems import RunningSystem, SystemSpec
from benchmarks.report import RESULTS_DIR, write_results

MODEL = "smollm2-135m"
SYSTEM_PROMPT = "You are a helpful assistant who answers at length."
QUESTION = "Tell me about the history of the printing press in Europe."
TOOL_QUESTION = "What is the weather in Paris?"
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ENDPOINTS = ("chat", "messages", "responses")
PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}
REQUEST_TIMEOUT_S = 300.0
STARTUP_TIMEOUT_S = 300.0


def request_body(endpoint: str, question: str, max_tokens: int, stream: bool, forced_tool: bool) -> dict:
    """One greedy request as `endpoint`'s protocol spells it."""
    if endpoint == "chat":
        body = {"messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}],
                "max_tokens": max_tokens}
        tools = {"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}}],
                 "tool_choice": "required"}
    elif endpoint == "messages":
        body = {"system": SYSTEM_PROMPT, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens}
        tools = {"tools": [{"name": "get_weather", "input_schema": WEATHER_SCHEMA}], "tool_choice": {"type": "any"}}
    else:
        body = {"instructions": SYSTEM_PROMPT, "input": question, "max_output_tokens": max_tokens}
        tools = {"tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER_SCHEMA}],
                 "tool_choice": "required"}
    return {"model": MODEL, "temperature": 0, "stream": stream, **body, **(tools if forced_tool else {})}


SCENARIOS = {  # name -> (question, streamed, forced tool call)
    "text": (QUESTION, False, False),
    "text, streamed": (QUESTION, True, False),
    "forced tool call": (TOOL_QUESTION, False, True),
}


def timed(http: httpx.Client, endpoint: str, body: dict) -> float:
    """Seconds from sending `body` to the last byte of its answer."""
    start = time.perf_counter()
    with http.stream("POST", PATHS[endpoint], json=body) as response:
        for _ in response.iter_bytes():
            pass
    elapsed = time.perf_counter() - start
    if response.status_code != 200:
        raise RuntimeError(f"{endpoint}: HTTP {response.status_code}")
    return elapsed


def measure(http: httpx.Client, scenario: tuple, max_tokens: int, num_rounds: int) -> dict[str, list[float]]:
    question, stream, forced_tool = scenario
    bodies = {endpoint: request_body(endpoint, question, max_tokens, stream, forced_tool) for endpoint in ENDPOINTS}
    for endpoint in ENDPOINTS:  # warm-up: the prompt enters the prefix cache for each alike
        timed(http, endpoint, bodies[endpoint])
    latencies: dict[str, list[float]] = {endpoint: [] for endpoint in ENDPOINTS}
    for round_index in range(num_rounds):
        shift = round_index % len(ENDPOINTS)
        for endpoint in ENDPOINTS[shift:] + ENDPOINTS[:shift]:
            latencies[endpoint].append(timed(http, endpoint, bodies[endpoint]))
    return latencies


def output_tokens(http: httpx.Client, scenario: tuple, max_tokens: int) -> dict[str, int]:
    """The tokens each endpoint generates for the scenario (whole, for its usage): the same work."""
    question, _, forced_tool = scenario
    counts = {}
    for endpoint in ENDPOINTS:
        usage = http.post(PATHS[endpoint], json=request_body(endpoint, question, max_tokens, False,
                                                             forced_tool)).json()["usage"]
        counts[endpoint] = usage.get("completion_tokens", usage.get("output_tokens"))
    return counts


def summary(latencies: dict[str, list[float]], tokens: dict[str, int]) -> dict:
    medians = {endpoint: statistics.median(values) for endpoint, values in latencies.items()}
    return {"median_ms": {e: 1000 * m for e, m in medians.items()},
            "range_ms": {e: (1000 * min(v), 1000 * max(v)) for e, v in latencies.items()},
            "ratio": {e: medians[e] / medians["chat"] for e in ENDPOINTS}, "output_tokens": tokens}


def markdown(rows: dict[str, dict], args: argparse.Namespace) -> str:
    lines = [f"The same greedy request (max {args.max_tokens} tokens) through each endpoint, one `tandem serve` "
             f"at its defaults, medians of {args.rounds} rounds in rotating order, {machine_label()}.", "",
             "| request | chat ms (min-max) | messages ms (min-max) | messages / chat | responses ms (min-max) "
             "| responses / chat | output tokens (chat, messages, responses) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name, row in rows.items():
        cells = [f"{row['median_ms'][e]:.0f} ({row['range_ms'][e][0]:.0f}-{row['range_ms'][e][1]:.0f})"
                 for e in ENDPOINTS]
        tokens = ", ".join(str(row["output_tokens"][e]) for e in ENDPOINTS)
        lines.append(f"| {name} | {cells[0]} | {cells[1]} | {row['ratio']['messages']:.3f}x | {cells[2]} "
                     f"| {row['ratio']['responses']:.3f}x | {tokens} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds per scenario, each endpoint once")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--serve-flags", default="", help="flags added to `tandem serve`")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "protocols.json")
    args = parser.parse_args(argv)
    command = f"{sys.executable} -m server.cli serve --port {{port}} --log-level warning {args.serve_flags}"
    rows = {}
    with tempfile.TemporaryDirectory(prefix="tandem-protocols-") as scratch, \
            RunningSystem(SystemSpec("tandem", command), Path(scratch) / "serve.log").start(STARTUP_TIMEOUT_S) \
            as running, httpx.Client(base_url=running.url, timeout=REQUEST_TIMEOUT_S) as http:
        for name, scenario in SCENARIOS.items():
            latencies = measure(http, scenario, args.max_tokens, args.rounds)
            rows[name] = summary(latencies, output_tokens(http, scenario, args.max_tokens))
            print(name, rows[name], file=sys.stderr, flush=True)
    write_results(args.output, {"rounds": args.rounds, "max_tokens": args.max_tokens, "rows": rows},
                  markdown(rows, args))
    print(args.output.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
