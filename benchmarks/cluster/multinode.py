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
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.load.client import Endpoint
from benchmarks.load.runner import run_requests
from benchmarks.load.stats import summarize
from benchmarks.load.systems import RunningSystem, SystemSpec
from benchmarks.load.workload import RequestSpec
from benchmarks.report import RESULTS_DIR, write_results
from benchmarks.cluster import netns_cluster
from engine.model_config import load_model_preset
from scheduler.planning.cost_model import TableCostModel
from scheduler.simulation.cluster import BITS_PER_BYTE, Layout, Link, simulate_costs, spread
from scheduler.simulation.simulator import Workload

RESULTS = RESULTS_DIR / "multinode.json"
SYSTEMS = {"tp2": ("-tp", "2"), "pp2": ("-pp", "2")}
LAYOUTS = {"tp2": Layout(tensor_parallel=2), "pp2": Layout(pipeline_parallel=2)}
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

ALLREDUCE_PORT = 7412
ALLREDUCE_CALLS = 300
# One all-reduce of the bench's decode step (streams x hidden size, bf16, as the ranks' residual
# stream) between a process in each node's namespace, through the ranks' own collectives: the
# median call, what the link model takes as its per-call cost beyond the wire.
ALLREDUCE_PROBE = """
import json, statistics, sys, time, torch
from engine.distributed.collectives import TorchCollectives
rank, node_ip, head_ip, port, numel, calls = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
group = TorchCollectives(int(rank), 2, f"tcp://{head_ip}:{port}", "gloo", node_ip)
tensor, times = torch.ones(int(numel), dtype=torch.bfloat16), []
for _ in range(int(calls)):
    start = time.perf_counter(); group.all_reduce(tensor); times.append(time.perf_counter() - start)
group.close()
print(json.dumps({"allreduce_s": statistics.median(times[len(times) // 10:])}))
"""
# What a message through Ray's compiled-graph channels (the plan, a stage's activation, the tokens)
# costs: a graph echoing one decode step's activations from the driver through an actor on the
# head's node, and through one on the worker's node, medians of many rounds.
CHANNEL_PROBE = """
import json, statistics, sys, time
import numpy as np, ray
from ray.dag import InputNode
ray.init(address=sys.argv[1], configure_logging=False, log_to_driver=False)
@ray.remote(num_cpus=1)
class Echo:
    def node(self):
        return ray.util.get_node_ip_address()
    def run(self, x):
        return x
near, far = sorted((Echo.remote(), Echo.remote()), key=lambda a: ray.get(a.node.remote()) != sys.argv[2])
x = np.zeros(int(sys.argv[3]), dtype=np.float16)
def round_s(actor):
    with InputNode() as inp:
        graph = actor.run.bind(inp).experimental_compile()
    times = []
    for _ in range(300):
        start = time.perf_counter(); ray.get(graph.execute(x)); times.append(time.perf_counter() - start)
    graph.teardown()
    return statistics.median(times[30:])
print(json.dumps({"local_round_s": round_s(near), "remote_round_s": round_s(far)}))
"""
# One rank's costs: the whole model on one core of this host (the testbed's GPU thread), measured
# by the engine's own profiler (the offloading scheduler's tables) in a process of its own, into a
# cache of its own.
RANK_PROFILE = """
import json, sys
import kernels  # before torch: its OpenMP spin cap
from engine.llm import LLM
with LLM(sys.argv[1], cpu_attention="on", gpu_threads=1, profile_grid="quick", profile_cache_dir=sys.argv[3]) as llm:
    print(json.dumps({"costs": llm.engine.cost_model.to_dict(),
                      "prompt_tokens": len(llm.engine.tokenizer.encode(sys.argv[2]))}))
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


def measure_allreduce(cluster, num_streams: int, hidden_size: int) -> dict:
    """A 2-rank gloo all-reduce of one decode step's activations across the node link."""
    head_ip, numel = netns_cluster.NODE_IPS[0], num_streams * hidden_size
    probes = [subprocess.Popen((*netns_cluster.netns_exec(namespace), sys.executable, "-c", ALLREDUCE_PROBE,
                                str(rank), netns_cluster.NODE_IPS[rank], head_ip, str(ALLREDUCE_PORT), str(numel),
                                str(ALLREDUCE_CALLS)), stdout=subprocess.PIPE, text=True,
                               env={**os.environ, **netns_cluster.RAY_ENV})
              for rank, namespace in enumerate((cluster.head_namespace, cluster.worker_namespace))]
    outputs = [probe.communicate(timeout=300)[0] for probe in probes]
    if any(probe.returncode for probe in probes):
        raise RuntimeError(f"the all-reduce probe failed: exit codes {[probe.returncode for probe in probes]}")
    return {**json.loads(outputs[0]), "allreduce_bytes": 2 * numel}


def measure_channels(cluster, num_streams: int, hidden_size: int) -> dict:
    """Round trips of a decode step's activations through compiled-graph channels, to an actor on
    the driver's node and to one across the link."""
    result = subprocess.run((*netns_cluster.netns_exec(cluster.head_namespace), sys.executable, "-c", CHANNEL_PROBE,
                             cluster.address, netns_cluster.NODE_IPS[0], str(num_streams * hidden_size)),
                            capture_output=True, text=True, timeout=300, check=True,
                            env={**os.environ, **netns_cluster.RAY_ENV})
    return json.loads(result.stdout.strip().splitlines()[-1])


def profile_one_rank() -> dict:
    """The engine's cost tables for the whole model on one core, and the prompt's length."""
    with tempfile.TemporaryDirectory() as cache_dir:  # measured now, not a cached profile of another day
        result = subprocess.run((sys.executable, "-c", RANK_PROFILE, MODEL, PROMPT, cache_dir), capture_output=True,
                                text=True, timeout=600, check=True, env={**os.environ, **netns_cluster.RAY_ENV})
    return json.loads(result.stdout.strip().splitlines()[-1])


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


def predict(result: dict) -> dict:
    """The simulator's output tokens/s for each system: one rank's profiled costs spread over two
    nodes on the link as measured (rate, round trip, the all-reduce's per-call cost), driving the
    scheduler through the bench's workload."""
    shape = load_model_preset(MODEL)[0]
    link_measured, allreduce = result["link"], result["allreduce"]
    link = Link.from_allreduce("node link", BITS_PER_BYTE * link_measured["bytes_per_s"] / 1e9,
                               link_measured["rtt_s"], allreduce["allreduce_s"], allreduce["allreduce_bytes"])
    base = TableCostModel.from_dict(result["rank_profile"]["costs"])
    workload = Workload(result["streams"], result["rank_profile"]["prompt_tokens"], result["max_tokens"], spread=0.0)
    return {name: simulate_costs(spread(base, layout, link, shape), workload).output_throughput
            for name, layout in LAYOUTS.items()} | {"link_call_s": link.call_s}


def run(args) -> dict:
    samples: dict[str, list[dict]] = {name: [] for name in SYSTEMS}
    rank_profile = profile_one_rank()
    with netns_cluster.running_cluster() as cluster:
        link = measure_link(cluster)
        hidden_size = load_model_preset(MODEL)[0].hidden_size
        allreduce = measure_allreduce(cluster, args.streams, hidden_size)
        channels = measure_channels(cluster, args.streams, hidden_size)
        for rep in range(args.reps):
            for name in (list(SYSTEMS) if rep % 2 == 0 else list(SYSTEMS)[::-1]):
                with system(cluster, name).start(STARTUP_TIMEOUT_S) as running:
                    measure(running.url, 1, 8)  # warm-up
                    samples[name].append(measure(running.url, args.streams, args.max_tokens))
    rows = {name: {key: statistics.median(s[key] for s in runs) for key in runs[0]} for name, runs in samples.items()}
    result = {"reps": args.reps, "streams": args.streams, "max_tokens": args.max_tokens, "rows": rows,
              "samples": samples, "link": link, "allreduce": allreduce, "channels": channels,
              "rank_profile": rank_profile}
    return result | {"predicted": predict(result)}


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
        f"interleaved repetitions.",
        *prediction_lines(result), ""])


def prediction_lines(result: dict) -> list[str]:
    predicted, rows, channels = result["predicted"], result["rows"], result["channels"]
    measured_ratio = rows["pp2"]["output_throughput"] / rows["tp2"]["output_throughput"]
    predicted_ratio = predicted["pp2"] / predicted["tp2"]
    return [
        "\nThe simulator on the same link (scheduler/simulation/cluster.py): one rank's costs as the engine profiles "
        "the whole model on one core, spread over two nodes; the link's per-call cost from a 2-rank gloo all-reduce "
        f"of one decode step's activations measured in the same run ({1e3 * result['allreduce']['allreduce_s']:.2f} ms, "
        f"{1e3 * predicted['link_call_s']:.2f} ms a call beyond the wire).",
        "", "| system | predicted output tokens/s | measured |", "|---|---|---|",
        *(f"| {flag} | {predicted[name]:.1f} | {rows[name]['output_throughput']:.1f} |"
          for name, flag in (("tp2", "-tp 2"), ("pp2", "-pp 2"))),
        f"\n-pp 2 / -tp 2 predicted {predicted_ratio:.2f}x against {measured_ratio:.2f}x measured "
        f"({predicted_ratio / measured_ratio - 1:+.0%}).",
        f"\nRay's compiled-graph channels, measured in the same run: {1e3 * channels['local_round_s']:.2f} ms a round "
        f"trip of one decode step's activations to an actor on the driver's node, "
        f"{1e3 * channels['remote_round_s']:.2f} ms to one across the link.",
    ]


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
