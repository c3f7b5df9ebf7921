"""Two nodes over a shaped link: `-tp 2` against `-pp 2`, a rank (stage) on each of two Ray nodes,
each node a network namespace of this host with one core, joined by a veth pair shaped by tbf to
1 Gbit/s (netns_cluster.py). Tensor parallelism all-reduces twice a layer over that link (gloo,
TCP); pipeline stages send one activation a step. Reported: decode tokens/s of N greedy streams
(aggregate output tokens over the wall time of the decode, TPOT p50), the two started afresh per
repetition and interleaved, medians. Needs root and iproute2 (`make bench-multinode`)."""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.load.client import Endpoint
from benchmarks.load.runner import run_requests
from benchmarks.load.stats import summarize
from benchmarks.load.systems import RunningSystem, SystemSpec
from benchmarks.load.workload import RequestSpec
from benchmarks.report import RESULTS_DIR, write_results
from benchmarks.cluster import netns_cluster

RESULTS = RESULTS_DIR / "multinode.json"
SYSTEMS = {"tp2": ("-tp", "2"), "pp2": ("-pp", "2")}
MODEL = "smollm2-135m"
PROMPT = "Write a long story about a lighthouse keeper and the sea."
LOG_DIR = Path("/tmp/tandem-bench-multinode")  # each system's server log
STARTUP_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 600.0
LINK_PORT = 7411
LINK_ROUND_TRIPS = 200
LINK_MIB = 64
# The link's bound, measured in the same run: a TCP sink in the worker's namespace echoes one byte
# per round trip, then takes a bulk send until the sender's end closes, and answers once it has.
LINK_SINK = """
import socket, sys
conn, _ = socket.create_server((sys.argv[1], int(sys.argv[2]))).accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
for _ in range(int(sys.argv[3])):
    conn.sendall(conn.recv(1))
while conn.recv(1 << 20):
    pass
conn.sendall(b"k")
"""
LINK_SENDER = """
import json, socket, sys, time
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(int(sys.argv[3])):
    start = time.perf_counter(); conn.sendall(b"x"); conn.recv(1); rtts.append(time.perf_counter() - start)
payload, start = bytes(1 << 20), time.perf_counter()
for _ in range(int(sys.argv[4])):
    conn.sendall(payload)
conn.shutdown(socket.SHUT_WR); conn.recv(1)
rtts.sort()
print(json.dumps({"rtt_s": rtts[len(rtts) // 2], "bytes_per_s": (int(sys.argv[4]) << 20) / (time.perf_counter() - start)}))
"""


def system(cluster, name: str) -> RunningSystem:
    """A server in the head's namespace, listening there, its actors on the two nodes."""
    command = " ".join((*netns_cluster.netns_exec(cluster.head_namespace), sys.executable, "-m", "server.cli", "serve",
                        *SYSTEMS[name], "--ray-address", cluster.address, "--host", cluster.server_host,
                        "--port", "{port}", "--log-level", "warning"))
    return RunningSystem(SystemSpec(name, command), LOG_DIR / f"{name}.log", env=netns_cluster.RAY_ENV,
                         host=cluster.server_host)


def measure_link(cluster) -> dict:
    """The node link's round trip (median) and TCP rate, head to worker."""
    worker_ip = netns_cluster.NODE_IPS[1]
    sink = subprocess.Popen((*netns_cluster.netns_exec(cluster.worker_namespace), sys.executable, "-c", LINK_SINK,
                             worker_ip, str(LINK_PORT), str(LINK_ROUND_TRIPS)))
    try:
        time.sleep(1.0)  # listening
        sent = subprocess.run((*netns_cluster.netns_exec(cluster.head_namespace), sys.executable, "-c", LINK_SENDER,
                               worker_ip, str(LINK_PORT), str(LINK_ROUND_TRIPS), str(LINK_MIB)),
                              capture_output=True, text=True, timeout=120, check=True)
    finally:
        sink.wait(30)
    return json.loads(sent.stdout)


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
    with netns_cluster.running_cluster() as cluster:
        link = measure_link(cluster)
        for rep in range(args.reps):
            for name in (list(SYSTEMS) if rep % 2 == 0 else list(SYSTEMS)[::-1]):
                with system(cluster, name).start(STARTUP_TIMEOUT_S) as running:
                    measure(running.url, 1, 8)  # warm-up
                    samples[name].append(measure(running.url, args.streams, args.max_tokens))
    rows = {name: {key: statistics.median(s[key] for s in runs) for key in runs[0]} for name, runs in samples.items()}
    return {"reps": args.reps, "streams": args.streams, "max_tokens": args.max_tokens, "rows": rows,
            "samples": samples, "link": link}


def markdown(result: dict) -> str:
    tp, pp, link = result["rows"]["tp2"], result["rows"]["pp2"], result["link"]
    return "\n".join([
        "| system | output tokens/s | TPOT p50 ms |", "|---|---|---|",
        f"| -tp 2 | {tp['output_throughput']:.1f} | {1e3 * tp['tpot_p50']:.1f} |",
        f"| -pp 2 | {pp['output_throughput']:.1f} | {1e3 * pp['tpot_p50']:.1f} |",
        f"\nThe link, measured in the same run: {8 * link['bytes_per_s'] / 1e9:.2f} Gbit/s over TCP, round trip "
        f"{1e3 * link['rtt_s']:.2f} ms (median of {LINK_ROUND_TRIPS}).",
        f"\n-pp 2 / -tp 2: {pp['output_throughput'] / tp['output_throughput']:.2f}x output tokens/s. The embedded "
        f"SmolLM2-135M (INT4), {result['streams']} greedy streams of {result['max_tokens']} tokens, two Ray nodes in "
        f"network namespaces (one core each) over a veth pair shaped to 1 Gbit/s; medians of {result['reps']} "
        f"interleaved repetitions.", ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    result = run(args)
    write_results(RESULTS, result, markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
