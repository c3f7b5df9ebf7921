"""Two nodes over a shaped link: `-tp 2` against `-pp 2`, a rank (stage) on each of two Ray nodes,
each node a network namespace of this host with one core, joined by a veth pair shaped by tbf to
1 Gbit/s (netns_cluster.py). Tensor parallelism all-reduces twice a layer over that link (gloo,
TCP); pipeline stages send one activation a step. Reported: decode tokens/s of N greedy streams
(aggregate output tokens over the wall time of the decode, TPOT p50), the two started afresh per
repetition and interleaved, medians. Needs root and iproute2 (`make bench-multinode`)."""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchmarks.load.client import Endpoint
from benchmarks.load.runner import run_requests
from benchmarks.load.stats import summarize
from benchmarks.load.systems import free_port
from benchmarks.load.workload import RequestSpec
from benchmarks.report import RESULTS_DIR, write_results
from benchmarks.cluster import netns_cluster

RESULTS = RESULTS_DIR / "multinode.json"
SYSTEMS = {"tp2": ("-tp", "2"), "pp2": ("-pp", "2")}
MODEL = "smollm2-135m"
PROMPT = "Write a long story about a lighthouse keeper and the sea."
STARTUP_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 600.0


def start_server(cluster, flags: tuple[str, ...], log_path: Path) -> tuple[subprocess.Popen, str]:
    """A server in the head's namespace, its actors on the two nodes; its process and URL once healthy."""
    port = free_port()
    url = f"http://{cluster.server_host}:{port}"
    command = (*netns_cluster.netns_exec(cluster.head_namespace), sys.executable, "-m", "server.cli", "serve",
               *flags, "--ray-address", cluster.address, "--host", cluster.server_host, "--port", str(port),
               "--log-level", "warning")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=netns_cluster.ROOT,
                                env={**os.environ, **netns_cluster.RAY_ENV})
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{' '.join(flags)} exited {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"{' '.join(flags)} not healthy after {STARTUP_TIMEOUT_S:g} s")


def measure(url: str, num_streams: int, max_tokens: int) -> dict:
    endpoint = Endpoint(url, MODEL, "completions", None, ignore_eos=True)
    specs = [RequestSpec(i, 0, max_tokens) for i in range(num_streams)]
    records = asyncio.run(run_requests(endpoint, specs, {i: PROMPT for i in range(num_streams)},
                                       concurrency=num_streams, request_timeout_s=REQUEST_TIMEOUT_S,
                                       max_duration_s=REQUEST_TIMEOUT_S, progress=False))
    summary = summarize(records)
    if summary["num_failed"]:
        raise RuntimeError(f"{summary['num_failed']} requests failed: {summary['first_error']}")
    return {"output_throughput": summary["output_throughput"], "tpot_p50": summary["tpot"]["p50"]}


def run(args) -> dict:
    samples: dict[str, list[dict]] = {name: [] for name in SYSTEMS}
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    with netns_cluster.running_cluster() as cluster:
        for rep in range(args.reps):
            for name in (list(SYSTEMS) if rep % 2 == 0 else list(SYSTEMS)[::-1]):
                proc, url = start_server(cluster, SYSTEMS[name], log_dir / f"{name}.log")
                try:
                    measure(url, 1, 8)  # warm-up
                    samples[name].append(measure(url, args.streams, args.max_tokens))
                finally:
                    proc.terminate()
                    proc.wait(60)
    rows = {name: {key: statistics.median(s[key] for s in runs) for key in runs[0]} for name, runs in samples.items()}
    return {"reps": args.reps, "streams": args.streams, "max_tokens": args.max_tokens, "rows": rows,
            "samples": samples}


def markdown(result: dict) -> str:
    tp, pp = result["rows"]["tp2"], result["rows"]["pp2"]
    return "\n".join([
        "| system | output tokens/s | TPOT p50 ms |", "|---|---|---|",
        f"| -tp 2 | {tp['output_throughput']:.1f} | {1e3 * tp['tpot_p50']:.1f} |",
        f"| -pp 2 | {pp['output_throughput']:.1f} | {1e3 * pp['tpot_p50']:.1f} |",
        f"\n-pp 2 / -tp 2: {pp['output_throughput'] / tp['output_throughput']:.2f}x output tokens/s. The embedded "
        f"SmolLM2-135M (INT4), {result['streams']} greedy streams of {result['max_tokens']} tokens, two Ray nodes in "
        f"network namespaces (one core each) over a veth pair shaped to 1 Gbit/s; medians of {result['reps']} "
        f"interleaved repetitions.", ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--log-dir", default="/tmp/tandem-bench-multinode")
    args = parser.parse_args(argv)
    result = run(args)
    write_results(RESULTS, result, markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
